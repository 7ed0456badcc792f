"""``GradSwap``: reduced gradients written behind to the optimizer's swap file, read back chunk by chunk by the step.

ZeRO-Infinity keeps parameters and optimizer states on NVMe; without this the fp32 reduced gradient shards (4Ψ/N
bytes per rank) stay in host memory until the step, and they are what bounds the model size. With it (ZeRO-3,
``offload_optimizer.device: "nvme"``, ``offload_gradients`` on; stage3/grad_offload.py is the stage's half):

- Each chunk of a stepped tensor has a fourth key in the swap file next to its three states, ``<chunk>/grad``
  (``GRAD_STATE``); the file is sized for it when the optimizer is built (``StreamedAdam.bytes_needed``).
- ``write(tensor, grad)`` starts writing ``grad`` (this rank's reduced gradient of the stepped ``tensor``) chunk
  by chunk and returns; the caller drops its reference, and this object keeps the tensor alive only until its
  writes are done. Writes in flight are bounded by ``window_bytes`` (sized from the measured disk bandwidth,
  disk_probe.py): past it the oldest are waited for, so a disk slower than backward throttles backward instead of
  letting gradients pile up in memory.
- ``read(chunk, out)`` is what ``stream_step`` uses: a chunk written this step is read from the file, one never
  written this step reads as zeros (no I/O), as a zeroed in-memory gradient would.
- ``scale`` (clip coefficient × fp16 unscale) is recorded, not applied: the step multiplies each chunk as it is
  read, as ``HostGradients`` does.

[Note: deferred gradient I/O failures] A write fails on one rank only (ENOSPC), and it surfaces while that rank
waits for it: in backward (the window), while accumulating (GAS > 1 reads the previous sum back) or at the step.
Raising in backward on one rank would leave its peers waiting in the next reduce-scatter. So failures met outside
the step are recorded (``failure``), the gradient in question reads as zeros, and the step raises the first one
from inside its agreed outcome ([Note: agreed offload step] in step_outcome.py): every rank raises the same
``SwapIOError`` naming the rank, swap file and tensor. The step never runs on a failed gradient.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from .chunks import Chunk
from .host_store import DoneHandle, StateStore
from .stream import Handle, state_key

GRAD_STATE = "grad"
"""Store key suffix of a chunk's gradient: ``<chunk>/grad``."""


class GradSwap:
    """Gradients of stepped tensors (cut into the optimizer's chunks) in ``store``; see the module docstring."""

    def __init__(self, store: StateStore, chunks_of: dict[int, list[Chunk]], window_bytes: int) -> None:
        self.store = store
        self.chunks_of = chunks_of  # id(stepped tensor) → its chunks (the optimizer's own table)
        self.window_bytes = max(1, window_bytes)
        self.written: set[str] = set()  # chunk names holding a gradient of this step
        self.scale = 1.0
        self.failure: BaseException | None = None  # [Note: deferred gradient I/O failures]
        self._in_flight: deque[tuple[list[Handle], int]] = deque()  # (handles of one write, its bytes)
        self.in_flight_bytes = 0
        self.peak_in_flight_bytes = 0
        self.bytes_written = 0  # since construction: what the benchmark reports
        self.bytes_read = 0

    def rebind(self, store: StateStore, chunks_of: dict[int, list[Chunk]]) -> None:
        """The optimizer rebuilt its chunks and store (re-layout): nothing written before carries over."""
        self.drain()
        self.store, self.chunks_of = store, chunks_of
        self.written.clear()

    def chunks(self, tensor: torch.Tensor) -> list[Chunk]:
        """``tensor``'s chunks; none for a stepped tensor the optimizer does not step (a trainable parameter left
        out of ``model_parameters``): its gradient is never read by the step, so the stage keeps it itself."""
        return self.chunks_of.get(id(tensor), [])

    def write(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Start writing ``grad`` (1-D CPU, ``tensor``'s size) as ``tensor``'s gradient; keep it alive until done."""
        handles: list[Handle] = []
        for chunk in self.chunks(tensor):
            handles.append(self.store.swap_out(state_key(chunk.name, GRAD_STATE), grad[chunk.start : chunk.end]))
            self.written.add(chunk.name)
        nbytes = grad.numel() * grad.element_size()
        self.bytes_written += nbytes
        self.retire_done()
        self._in_flight.append((handles, nbytes))
        self.in_flight_bytes += nbytes
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)
        while len(self._in_flight) > 1 and self.in_flight_bytes > self.window_bytes:
            self._retire_oldest()

    def read_into(self, tensor: torch.Tensor, out: torch.Tensor) -> list[Handle]:
        """Start reading ``tensor``'s gradient of this step into ``out`` (1-D, its size): chunks not written read as
        zeros. Wait on the returned handles before using ``out`` (``wait_reads`` defers a failure)."""
        return [self.read(chunk, out[chunk.start : chunk.end]) for chunk in self.chunks(tensor)]

    def read(self, chunk: Chunk, out: torch.Tensor) -> Handle:
        """Start reading ``chunk``'s gradient into ``out``; zeros without I/O when none was written this step."""
        if chunk.name not in self.written:
            out.zero_()
            return DoneHandle(out)  # type: ignore[return-value]
        self.bytes_read += out.numel() * out.element_size()
        return self.store.swap_in(state_key(chunk.name, GRAD_STATE), out)

    def has(self, tensor: torch.Tensor) -> bool:
        return any(chunk.name in self.written for chunk in self.chunks(tensor))

    def wait_deferred(self, handles: Sequence[Handle]) -> bool:
        """Wait for ``handles`` outside the step: a failure is recorded, not raised. True if all succeeded."""
        ok = True
        for handle in handles:
            try:
                handle.wait()
            except OSError as error:
                ok = False
                if self.failure is None:
                    self.failure = error
        return ok

    def retire_done(self) -> None:
        """Drop the oldest writes that have finished: their memory can go now, not when the window fills."""
        while self._in_flight and all(getattr(h, "done", lambda: True)() for h in self._in_flight[0][0]):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        handles, nbytes = self._in_flight.popleft()
        self.in_flight_bytes -= nbytes
        self.wait_deferred(handles)

    def drain(self) -> None:
        """Wait for every write in flight (failures deferred); their tensors are released."""
        while self._in_flight:
            self._retire_oldest()

    def raise_failure(self) -> None:
        """Inside the agreed step: every write done, and the first deferred failure raised (then forgotten)."""
        self.drain()
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def forget(self, chunk_names: Sequence[str] | None = None) -> None:
        """The step is over or the gradients were cleared: those chunks (default: all) hold no gradient now."""
        if chunk_names is None:
            self.written.clear()
        else:
            self.written.difference_update(chunk_names)

    def reset_scale(self) -> None:
        self.scale = 1.0
