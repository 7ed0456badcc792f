"""The host buffers that ``offload_param`` reads shards from the swap file into (param_offload.py): at most
``buffer_count`` reusable page-aligned buffers, pinned when the units live on a CUDA device, and the deferred
release of a buffer an asynchronous host-to-device copy is still reading ([Note: asynchronous host-to-device
copies] in param_offload.py); ``shards_in_flight``, the buffer count a prefetch depth needs (the pool's hint)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shardspeed.log import logger
from shardspeed.offload.aio_config import PAGE_SIZE
from shardspeed.offload.aligned import aligned_empty, round_up

KEY = "zero_optimization.offload_param"


def shards_in_flight(numels: Sequence[int], swapped: Sequence[bool], prefetch_numel: int, max_live_numel: int) -> int:
    """How many swapped shards a pass holds at once, at least 1: after acquiring a unit the runtime has prefetched
    (``gather``, which reads the shard) the following units within ``prefetch_numel`` elements and under
    ``max_live_numel`` live ones; each stays read in until its all-gather is waited. Mirrors prefetch.py's
    ``_prefetch_after`` over the units in order (forward) and reversed (backward); a hint for ``buffer_count``."""
    most = 1
    for order in (list(range(len(numels))), list(reversed(range(len(numels))))):
        for position, current in enumerate(order):
            budget, live, count = prefetch_numel, numels[current], 0
            for ahead in order[position + 1 :]:
                if numels[ahead] > budget or live + numels[ahead] > max_live_numel:
                    break
                live, budget, count = live + numels[ahead], budget - numels[ahead], count + swapped[ahead]
                if budget <= 0:
                    break
            most = max(most, count)
    return most


class CopyDone(Protocol):
    """Completion of an asynchronous copy (``torch.cuda.Event`` recorded right after it; tests pass a fake)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class ShardBufferPool:
    """Up to ``buffer_count`` reusable page-aligned host buffers of ``buffer_bytes`` each, allocated on demand.

    ``acquire`` hands out a free buffer (viewed as the asked dtype and length); ``release`` takes it back. When
    all ``buffer_count`` are in use it does not block (the shards in use are waiting on collectives that only this
    rank's progress completes) but returns a temporary buffer, counts it in ``overflows`` and warns once,
    suggesting ``max(suggested_count, buffers in use + 1)`` buffers.

    ``pin``: allocate page-locked buffers (when the units live on a CUDA device), so a host-to-device copy out of
    one can run asynchronously; ``release_after`` then hands a buffer back only once its copy has completed
    ([Note: asynchronous host-to-device copies])."""

    def __init__(self, buffer_count: int, buffer_bytes: int, *, suggested_count: int = 0, pin: bool = False) -> None:
        if buffer_count < 1 or buffer_bytes < 1:
            raise ValueError(f"buffer_count = {buffer_count}, buffer_bytes = {buffer_bytes}; valid: both >= 1")
        self.buffer_count, self.buffer_bytes = buffer_count, buffer_bytes
        self.suggested_count = suggested_count
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._in_use: dict[int, torch.Tensor] = {}  # data_ptr → the whole uint8 buffer handed out there
        self._pending: list[tuple[CopyDone, torch.Tensor]] = []  # released once the copy reading them completed
        self.allocated = 0
        self.peak_in_use = 0
        self.overflows = 0
        self.waited_copies = 0  # acquires that had to wait for a copy (the pool would have overflowed otherwise)

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds (temporary overflow buffers not included: they are freed when released)."""
        return self.allocated * self.buffer_bytes

    @property
    def in_use(self) -> int:
        """Pool buffers handed out and not yet released."""
        return len(self._in_use)

    @property
    def pending(self) -> int:
        """Buffers (pool or temporary) whose asynchronous copy may still be reading them."""
        return len(self._pending)

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned 1-D tensor of ``numel`` elements of ``dtype`` (uninitialised)."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.buffer_bytes:
            raise ValueError(
                f"{numel} elements of {dtype} ({nbytes} bytes) exceed the {self.buffer_bytes}-byte buffers"
            )
        self._collect_copied()
        if not self._free and self.allocated >= self.buffer_count:
            self._wait_for_a_copy()
        if self._free:
            buffer = self._free.pop()
        elif self.allocated < self.buffer_count:
            buffer = self._new_buffer()
            self.allocated += 1
        else:
            self._overflow()
            return aligned_empty(numel, dtype)
        self._in_use[buffer.data_ptr()] = buffer
        self.peak_in_use = max(self.peak_in_use, len(self._in_use))
        return buffer[:nbytes].view(dtype)

    def try_acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Like ``acquire``, but None instead of a temporary buffer when every pool buffer is in use (or still read
        by a copy): reading ahead is optional, and must never push the pool past ``buffer_count`` or wait."""
        self._collect_copied()
        if not self._free and self.allocated >= self.buffer_count:
            return None
        return self.acquire(numel, dtype)

    def release_after(self, tensor: torch.Tensor, done: CopyDone) -> None:
        """Return ``tensor``'s buffer once ``done`` reports that the asynchronous copy reading it has completed:
        reused earlier, the next shard read into it could overwrite values the copy has not moved yet. Checked
        without waiting at each acquire; waited for only when the pool would otherwise overflow (or at
        ``settle``). Temporary buffers are kept alive here too until their copy is done."""
        self._pending.append((done, tensor))

    def settle(self) -> None:
        """Wait for every pending copy and take its buffer back (before closing the store)."""
        for done, tensor in self._pending:
            done.synchronize()
            self.release(tensor)
        self._pending.clear()

    def _collect_copied(self) -> None:
        """Take back the buffers whose copies have completed, without waiting for the others."""
        if not self._pending:
            return
        waiting = []
        for done, tensor in self._pending:
            if done.query():
                self.release(tensor)
            else:
                waiting.append((done, tensor))
        self._pending = waiting

    def _wait_for_a_copy(self) -> None:
        """Every pool buffer is handed out: if one is only waiting for its copy, wait for the oldest such copy
        (microseconds to a few milliseconds on the device) rather than overflowing into a temporary buffer."""
        for position, (done, tensor) in enumerate(self._pending):
            if tensor.data_ptr() in self._in_use:
                del self._pending[position]
                done.synchronize()
                self.waited_copies += 1
                self.release(tensor)
                return

    def _new_buffer(self) -> torch.Tensor:
        if self.pin:
            # Page-locked, so copies to the device can be asynchronous. The CUDA host allocator hands out
            # page-aligned blocks, and whole pages here, so O_DIRECT still reads into it in place (the swapper
            # stages through its own buffers otherwise: slower, still correct).
            return torch.empty(round_up(self.buffer_bytes, PAGE_SIZE), dtype=torch.uint8, pin_memory=True)
        return aligned_empty(self.buffer_bytes, torch.uint8)

    def release(self, tensor: torch.Tensor) -> None:
        """Return ``tensor``'s buffer to the pool; a temporary (overflow) or foreign tensor is just dropped."""
        buffer = self._in_use.pop(tensor.data_ptr(), None)
        if buffer is not None:
            self._free.append(buffer)

    def _overflow(self) -> None:
        self.overflows += 1
        if self.overflows > 1:
            return
        needed = max(self.suggested_count, len(self._in_use) + 1)
        logger.warning(
            f"{KEY}.buffer_count = {self.buffer_count}: {len(self._in_use) + 1} parameter shards read from NVMe "
            "were needed in memory at once (the unit being gathered, the units prefetched ahead within "
            "stage3_prefetch_bucket_size, any held by GatheredParameters); the extra ones use temporary buffers "
            f"(counted in pool_overflows). Set buffer_count to at least {needed}, or lower "
            "stage3_prefetch_bucket_size, to keep them in the pool. Warned once."
        )
