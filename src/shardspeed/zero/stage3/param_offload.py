"""``zero_optimization.offload_param``: ZeRO-3 parameter shards kept off the training device between uses.

A ``ParamOffloader`` owns a store (a ``TensorSwapper`` swap file for ``device: "nvme"``, pinned host tensors for
``device: "cpu"`` with an accelerator) and is attached to every non-persistent ``ParamUnit`` it moves. The unit
then keeps its shard *resident* only while it needs it (see unit.py, [Note: offloaded shard]): ``gather()`` reads
the shard in before launching the all-gather (the runtime's prefetch calls ``gather()`` a unit ahead, so the read
overlaps the previous unit's compute) and ``wait()`` drops it again once the all-gather has copied it.

Supported combinations (``check_param_offload``), chosen as the simplest that stay exactly correct:

- ``device: "cpu"`` on a machine without an accelerator is a no-op: the shards already live in host memory (the
  three keys below then have no effect either).
- bf16/fp16: the optimizer steps the fp32 *master* shards, which stay in memory, and checkpoints read the masters
  too; the low-precision shard is only the all-gather's source, so it can live in the store between uses.
- fp32: the optimizer's tensors *are* slices of the shard, so the shard can only leave memory if the optimizer
  can reach it elsewhere: this needs ``offload_optimizer`` with a streamed optimizer (``device: "nvme"``, or
  ``"cpu"`` with an accelerator), else it is a clear ``ConfigError``. The optimizer's stepped tensors become
  storage-less stand-ins (``stand_in``) and ``ShardSlices`` (shard_slices.py) tells ``StreamedAdam`` where their
  values are: it reads the owning unit's shard just before the tensor's first chunk is written and writes it
  back right after its last, so one unit's shard is in memory at a time. The optimizer's store also keeps the
  fp32 values (it steps from them); the unit's store holds the copy the all-gathers and checkpoints read.

The DeepSpeed tuning keys apply to ``device: "nvme"`` (with ``"cpu"`` nothing is read from a file):

- ``max_in_cpu`` (elements per rank): walking the units in order, the leading units whose shards add up to at
  most ``max_in_cpu`` stay in host memory and never touch the swap file (``split_by_max_in_cpu``); the rest go
  to NVMe. Without an accelerator those shards already are in host memory, so their units are simply not
  offloaded; with one they move to pinned host memory. The swap file is sized for the NVMe units only, and not
  opened at all when none go there. DeepSpeed's default (1e9) keeps every unit of a model below 1e9 elements per
  rank in host memory: set it lower (0: everything) to put parameters on NVMe.
- ``buffer_count`` / ``buffer_size``: shards read from the swap file go into ``ShardBufferPool`` (shard_pool.py),
  at most ``buffer_count`` reusable page-aligned buffers (O_DIRECT reads into them in place; pinned on a CUDA
  device) of ``buffer_size`` elements, so host memory for swapped shards stays bounded. A shard larger than
  ``buffer_size`` is a ``ConfigError``. When more shards are in memory at once than there are buffers (prefetch
  depth, a ``GatheredParameters`` over many units) the extra ones get a temporary buffer, counted in
  ``pool_overflows``, with one warning.

[Note: read-ahead] ``gather()`` reads the shard and waits for the read before launching the all-gather, so a read
issued there blocks the hook that issues it. The runtime therefore also calls ``read_ahead`` for the next unit of
the recorded order *past* the ones it gathers (prefetch): the read is issued asynchronously through the swapper
and runs while the current unit computes; when that unit's turn comes, ``empty_shard`` hands out the filled
buffer and ``read`` has nothing left to do. Reads ahead only take a *free* pool buffer (``try_acquire``), so they
never push the pool past ``buffer_count``; one nobody consumed is dropped at the end of each forward / backward
(``cancel_reads_ahead``), and a write to the store drops the unit's read ahead (its values would be old).

[Note: asynchronous host-to-device copies] On a CUDA device a shard read from the swap file lands in a pool buffer
and is then copied to the device. The pool's buffers are pinned there (``ShardBufferPool(pin=True)``), so that
copy is issued with ``non_blocking=True`` and the hook returns at once; the all-gather that reads the device shard
is launched on the same (current) stream, so it runs after the copy. The host buffer must not be reused until the
copy has read it: a CUDA event is recorded after the copy and the buffer goes back to the pool only when the event
has completed (``release_after``; checked without waiting at each acquire, waited for only when the pool would
otherwise overflow). Shards kept in (pinned) host memory (``device: "cpu"``, or ``max_in_cpu``) are copied to the
device non-blocking too, straight from the ``HostStore`` tensor: it is never reused for another shard, and its
only writer is ``write``'s device-to-host copy, queued behind. On the CPU nothing changes: no copy to a device, no
events, buffers released at once.
Device → host (``write``) stays blocking: the swap file write reads the host buffer right away, so a
non-blocking copy would have to be waited for before it, gaining nothing. Verified on CUDA only by
``make gpu-check`` (the performance issue's GPU check); CPU tests cover the release bookkeeping with fake events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from shardspeed.config.errors import ConfigError
from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.host_store import HostStore, StateStore
from shardspeed.offload.setup import open_swapper_on_every_rank
from shardspeed.offload.swapper import SwapHandle, TensorSwapper
from shardspeed.zero.stage3.shard_pool import KEY, ShardBufferPool, shards_in_flight
from shardspeed.zero.stage3.shard_slices import ShardSlices as ShardSlices  # re-exported

if TYPE_CHECKING:
    from shardspeed.zero.stage3.unit import ParamUnit


def split_by_max_in_cpu(shard_numels: Sequence[int], max_in_cpu: int) -> list[bool]:
    """For units in order (their shard sizes), whether each stays in host memory under ``max_in_cpu``.

    The longest leading run whose sizes add up to at most ``max_in_cpu`` stays; from the first unit that does not
    fit on, everything goes to NVMe (a later small unit is not squeezed into the leftover: placement stays one
    contiguous block of the model, like DeepSpeed's flat CPU buffer filled in order). Sizes are per-rank shard
    sizes, equal on every rank, so every rank splits identically."""
    kept, total = [], 0
    for numel in shard_numels:
        total += numel  # counts the units that did not fit too, so once over the limit it stays over
        kept.append(total <= max_in_cpu)
    return kept


class ParamOffloader:
    """Reads and writes unit shards under the name ``unit<index>``: to ``store`` (swap file or host memory), or,
    for units ``max_in_cpu`` keeps in host memory on a machine with an accelerator, to ``host_store``. Units in
    ``in_cpu_units`` whose shard already lives in host memory are not moved at all (``moves``)."""

    def __init__(
        self,
        store: StateStore | None,
        device_kind: str,
        *,
        pool: ShardBufferPool | None = None,
        host_store: StateStore | None = None,
        in_cpu: Sequence[ParamUnit] = (),
    ) -> None:
        self.store = store  # None: no unit goes to NVMe (max_in_cpu covers all)
        self.device_kind = device_kind  # "cpu" or "nvme": what the config asked for
        self.pool = pool
        self.host_store = host_store
        self.in_cpu_units = frozenset(u.index for u in in_cpu)  # kept in host memory by max_in_cpu
        self.in_cpu_bytes = sum(u.shard_numel * u.dtype.itemsize for u in in_cpu)
        self._stored: dict[str, int] = {}  # key → bytes last written to ``store``
        self._ahead: dict[int, tuple[torch.Tensor, SwapHandle]] = {}  # unit index → (pool buffer, read in flight)
        self._ready: dict[int, torch.Tensor] = {}  # unit index → a read-ahead buffer handed out, already filled

    @staticmethod
    def key(unit: ParamUnit) -> str:
        return f"unit{unit.index}"

    @property
    def offloaded_bytes(self) -> int:
        """Shard bytes held by ``store`` (for ``device: "nvme"``: on disk)."""
        return sum(self._stored.values())

    @property
    def swap_file_bytes(self) -> int:
        """Size of the swap file (block-rounded slots of the NVMe units); 0 without one."""
        return self.store.capacity_bytes if isinstance(self.store, TensorSwapper) else 0

    @property
    def pool_bytes(self) -> int:
        """Host memory allocated by the buffer pool for shards read from the swap file."""
        return self.pool.allocated_bytes if self.pool is not None else 0

    @property
    def pool_overflows(self) -> int:
        """Reads that found every pool buffer in use and took a temporary buffer."""
        return self.pool.overflows if self.pool is not None else 0

    def moves(self, unit: ParamUnit) -> bool:
        """Whether ``unit``'s shard leaves where it is: not for a unit kept in host memory that already lives there."""
        return unit.index not in self.in_cpu_units or unit.device.type != "cpu"

    def _store_for(self, unit: ParamUnit) -> StateStore:
        store = self.host_store if unit.index in self.in_cpu_units else self.store
        assert store is not None, f"ZeRO-3 unit '{unit.name}' has no offload store"
        return store

    def _host_shard(self, unit: ParamUnit) -> torch.Tensor:
        """Host memory for ``unit``'s shard: a pool buffer when the shard comes from the swap file."""
        if self.pool is not None and unit.index not in self.in_cpu_units:
            return self.pool.acquire(unit.shard_numel, unit.dtype)
        return torch.empty(unit.shard_numel, dtype=unit.dtype)

    # --- read-ahead ([Note: read-ahead]) ------------------------------------------------------------------------
    def read_ahead(self, unit: ParamUnit) -> bool:
        """Start reading ``unit``'s shard from the swap file into a free pool buffer, without waiting; False when it
        does not apply (not an NVMe unit, already reading) or no pool buffer is free."""
        if unit.index in self._ahead or unit.index in self.in_cpu_units or self.pool is None or self.store is None:
            return False
        buffer = self.pool.try_acquire(unit.shard_numel, unit.dtype)
        if buffer is None:
            return False
        self._ahead[unit.index] = (buffer, self.store.swap_in(self.key(unit), buffer))
        return True

    def _take_ahead(self, unit: ParamUnit) -> torch.Tensor | None:
        """The read-ahead buffer of ``unit`` once its read completed (None if none was started)."""
        ahead = self._ahead.pop(unit.index, None)
        if ahead is None:
            return None
        buffer, handle = ahead
        try:
            handle.wait()
        except BaseException:
            self.release_shard(buffer)
            raise
        return buffer

    def cancel_reads_ahead(self) -> None:
        """Drop reads ahead nobody consumed (the pass went elsewhere, or ended): wait for them, free the buffers."""
        for index in list(self._ahead):
            buffer, handle = self._ahead.pop(index)
            try:
                handle.wait()
            finally:
                self.release_shard(buffer)
        self._ready.clear()  # handed out: those buffers are their units' shards now, released by the units

    def empty_shard(self, unit: ParamUnit) -> torch.Tensor:
        """A buffer for ``unit``'s shard, on its device; hand it back with ``release_shard`` when done. A host
        shard whose read-ahead completed comes back already filled (``read`` then has nothing left to do)."""
        if unit.device.type == "cpu":
            ready = self._take_ahead(unit)
            if ready is not None:
                self._ready[unit.index] = ready
                return ready
            return self._host_shard(unit)
        return torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)

    def release_shard(self, shard: torch.Tensor) -> None:
        """``shard`` (from ``empty_shard``) is no longer used: a pool buffer is free again (others are dropped)."""
        if self.pool is not None and shard.device.type == "cpu":
            self.pool.release(shard)

    def write(self, unit: ParamUnit, shard: torch.Tensor) -> None:
        """Store ``shard`` (blocking: the caller frees it right after)."""
        store, key = self._store_for(unit), self.key(unit)
        stale = self._take_ahead(unit)  # read before this write: its values are old
        if stale is not None:
            self.release_shard(stale)
        self._ready.pop(unit.index, None)
        if shard.device.type == "cpu" or isinstance(store, HostStore):
            store.swap_out(key, shard).wait()
        else:  # device → swap file through a host buffer
            host = self._host_shard(unit)
            host.copy_(shard)
            store.swap_out(key, host).wait()
            self.release_shard(host)
        if store is self.store:
            self._stored[key] = shard.numel() * shard.element_size()

    def read(self, unit: ParamUnit, out: torch.Tensor) -> None:
        """Fill ``out`` with ``unit``'s stored shard (the file read blocks; a read started ahead is only waited
        for; the copy to a CUDA device is asynchronous, see [Note: asynchronous host-to-device copies])."""
        if self._ready.pop(unit.index, None) is out:
            return
        store, key = self._store_for(unit), self.key(unit)
        ahead = self._take_ahead(unit)
        if ahead is not None:  # a device shard: the read went to a host buffer ahead of time
            self._copy_to_device(out, ahead)
            return
        if isinstance(store, HostStore) and out.device.type == "cuda":
            # The stored copy is never reused for anything else and is only rewritten by ``write`` with a copy
            # from the device, queued on the stream behind this one: no event needed. Pinned (pin_memory) → the
            # copy is asynchronous; verified on CUDA only by `make gpu-check`.
            held = store.held(key)
            out.view(-1).copy_(held, non_blocking=held.is_pinned())
            return
        if out.device.type == "cpu" or isinstance(store, HostStore):
            store.swap_in(key, out).wait()
            return
        host = self._host_shard(unit)
        try:
            store.swap_in(key, host).wait()
        except BaseException:
            self.release_shard(host)
            raise
        self._copy_to_device(out, host)

    def _copy_to_device(self, out: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a filled host buffer (from ``_host_shard``) into the device shard ``out``, then hand it back."""
        if out.device.type == "cuda" and self.pool is not None and host.is_pinned():
            # [Note: asynchronous host-to-device copies]; verified on CUDA only by `make gpu-check`.
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()  # on the current stream, right after the copy
            self.pool.release_after(host, done)
            return
        out.copy_(host)
        self.release_shard(host)

    def close(self) -> None:
        """Release the stores (for NVMe: the swap file)."""
        self.cancel_reads_ahead()
        if self.pool is not None:
            self.pool.settle()
        for store in (self.store, self.host_store):
            if store is not None:
                store.close()


def needs_offloader(device: str, has_accelerator: bool) -> bool:
    """Whether ``offload_param.device`` moves anything: "cpu" without an accelerator is where shards already are."""
    return device == "nvme" or (device == "cpu" and has_accelerator)


def check_param_offload(
    device: str, stage: int, mixed_precision: bool, has_accelerator: bool, optimizer_device: str = "none"
) -> None:
    """The combinations ``offload_param`` runs with (see the module docstring); the rest are ``ConfigError``s.
    ``optimizer_device``: ``offload_optimizer.device``."""
    if device == "none":
        return
    if stage != 3:
        raise ConfigError(
            f'zero_optimization.offload_param.device = "{device}" needs ZeRO stage 3 (only stage 3 shards '
            f"parameters), but zero_optimization.stage is {stage}; set the stage to 3 or the device to none"
        )
    streamed_optimizer = needs_offloader(optimizer_device, has_accelerator)  # StreamedAdam reaches the shards
    if needs_offloader(device, has_accelerator) and not mixed_precision and not streamed_optimizer:
        raise ConfigError(
            f'zero_optimization.offload_param.device = "{device}" in fp32 needs the optimizer offloaded too '
            f'(zero_optimization.offload_optimizer.device is "{optimizer_device}"): in fp32 the optimizer steps '
            "the parameter shards themselves, and only the streamed optimizer of offload_optimizer can step them "
            'while they are off memory. Set offload_optimizer.device to "nvme"'
            + (' or "cpu"' if has_accelerator else "")
            + ', train in bf16 or fp16, or set offload_param.device to "none"'
        )


def build_param_offloader(
    units: Sequence[ParamUnit],
    device: str,
    *,
    nvme_path: str | None,
    pin_memory: bool,
    settings: AioSettings,
    rank: int,
    agree: Callable[[object], list[object]],
    buffer_count: int = 5,
    buffer_size: int = 100_000_000,
    max_in_cpu: int = 0,
    prefetch_numel: int = 0,
    max_live_numel: int = 0,
) -> ParamOffloader:
    """The store for ``units``' shards (non-persistent, in unit order). ``"nvme"`` reads ``buffer_count``,
    ``buffer_size``, ``max_in_cpu`` (module docstring; the engine passes the config's values, this default sends
    every unit to NVMe); ``prefetch_numel`` / ``max_live_numel`` (stage 3's prefetch settings) only size the
    buffer_count the pool's warning suggests. Collective for ``"nvme"`` (``agree`` all-gathers a small object):
    every rank learns every rank's configuration problem and whether any has units for NVMe, so all raise the
    same ``ConfigError`` or all open a swap file together (an ``nvme_path`` unusable on one rank fails all)."""
    if device == "cpu":
        return ParamOffloader(HostStore(pin_memory), device)
    if device != "nvme":
        raise ValueError(f"offload_param.device = {device!r}; valid: none, cpu, nvme")
    if not nvme_path:
        raise ConfigError(f'{KEY}.device = "nvme" needs "nvme_path": a writable directory')
    in_cpu = split_by_max_in_cpu([u.shard_numel for u in units], max_in_cpu)
    to_nvme = [u for u, kept in zip(units, in_cpu) if not kept]
    verdicts: list = agree((_pool_problem(to_nvme, buffer_count, buffer_size), bool(to_nvme)))
    problems = [problem for problem, _ in verdicts if problem is not None]
    if problems:
        raise ConfigError(problems[0])
    kept = [u for u, kept in zip(units, in_cpu) if kept]
    host_store = HostStore(pin_memory) if any(u.device.type != "cpu" for u in kept) else None
    store: TensorSwapper | None = None
    pool: ShardBufferPool | None = None
    if any(has_nvme_units for _, has_nvme_units in verdicts):
        sizes = [u.shard_numel * u.dtype.itemsize for u in to_nvme]
        store = open_swapper_on_every_rank(
            nvme_path,
            lambda: max(TensorSwapper.bytes_needed(sizes, settings), 1),
            settings,
            key=f"{KEY}.nvme_path",
            job_prefix="shardspeed-params",
            rank=rank,
            agree=agree,
        )
    if to_nvme:
        # Buffers as large as the largest shard that goes through them (never more than buffer_size elements):
        # a pool of buffer_size-element buffers would reserve far more than a small model's shards need.
        largest = max(u.shard_numel for u in to_nvme)
        itemsize = max(u.dtype.itemsize for u in to_nvme)
        swapped = [not kept for kept in in_cpu]
        suggested = shards_in_flight([u.numel for u in units], swapped, prefetch_numel, max_live_numel)
        # Pinned when the units live on a CUDA device: their host-to-device copies are then asynchronous ([Note:
        # asynchronous host-to-device copies]); DeepSpeed's parameter swapper pins its buffers the same way.
        pin = any(u.device.type == "cuda" for u in to_nvme)
        pool = ShardBufferPool(buffer_count, largest * itemsize, suggested_count=suggested, pin=pin)
    return ParamOffloader(store, device, pool=pool, host_store=host_store, in_cpu=kept)


def _pool_problem(to_nvme: Sequence[ParamUnit], buffer_count: int, buffer_size: int) -> str | None:
    """Why ``buffer_count`` / ``buffer_size`` cannot serve the units that go to NVMe (None: they can)."""
    if buffer_count < 1:
        return (
            f"{KEY}.buffer_count = {buffer_count}; valid: at least 1 (host buffers that parameter shards are read "
            "into from NVMe)"
        )
    if not to_nvme:
        return None
    largest = max(to_nvme, key=lambda u: u.shard_numel)
    if largest.shard_numel <= buffer_size:
        return None
    return (
        f"{KEY}.buffer_size = {buffer_size} is smaller than the largest parameter shard that goes to NVMe: ZeRO-3 "
        f"unit '{largest.name}' (first parameter '{largest.names[0]}') has {largest.shard_numel} elements per rank, "
        f"and each buffer holds one whole shard. Set buffer_size to at least {largest.shard_numel}, or raise "
        "max_in_cpu to keep that unit in host memory"
    )
