"""``zero_optimization.offload_param``: ZeRO-3 parameter shards kept off the training device between uses.

A ``ParamOffloader`` owns a store (a ``TensorSwapper`` swap file for ``device: "nvme"``, pinned host tensors for
``device: "cpu"`` with an accelerator) and is attached to every non-persistent ``ParamUnit``. The unit then keeps
its shard *resident* only while it needs it (see unit.py, [Note: offloaded shard]): ``gather()`` reads the shard
in before launching the all-gather (the runtime's prefetch calls ``gather()`` a unit ahead, so the read overlaps
the previous unit's compute) and ``wait()`` drops it again once the all-gather has copied it.

Supported combinations (``check_param_offload``), chosen as the simplest that stay exactly correct:

- ``device: "cpu"`` on a machine without an accelerator is a no-op: the shards already live in host memory.
- bf16/fp16: the optimizer steps the fp32 *master* shards, which stay in memory, and checkpoints read the masters
  too; the low-precision shard is only the all-gather's source, so it can live in the store between uses.
- fp32: the optimizer's tensors *are* slices of the shard, so the shard can only leave memory if the optimizer
  can reach it elsewhere: this needs ``offload_optimizer`` with a streamed optimizer (``device: "nvme"``, or
  ``"cpu"`` with an accelerator), else it is a clear ``ConfigError``. The optimizer's stepped tensors become
  storage-less stand-ins (``stand_in``) and ``ShardSlices`` tells ``StreamedAdam`` where their values are: it
  reads the owning unit's shard just before the tensor's first chunk is written and writes it back right after
  its last, so one unit's shard is in memory at a time. The optimizer's store also keeps the fp32 values (it
  steps from them); the unit's store holds the copy the all-gathers and checkpoints read.

``buffer_count``, ``buffer_size`` and ``max_in_cpu`` are accepted for DeepSpeed compatibility and have no effect:
one shard at a time is read into a freshly allocated (page-aligned, so O_DIRECT needs no staging copy) buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from shardspeed.config.errors import ConfigError
from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.optimizer import HostStore, StateStore
from shardspeed.offload.setup import open_swapper_on_every_rank
from shardspeed.offload.swapper import TensorSwapper, aligned_empty

if TYPE_CHECKING:
    from shardspeed.zero.stage3.unit import ParamUnit


class ParamOffloader:
    """Reads and writes unit shards to ``store`` under the name ``unit<index>``."""

    def __init__(self, store: StateStore, device_kind: str) -> None:
        self.store = store
        self.device_kind = device_kind  # "cpu" or "nvme": what the config asked for
        self.offloaded_bytes = 0  # bytes of shard data that live in the store

    @staticmethod
    def key(unit: ParamUnit) -> str:
        return f"unit{unit.index}"

    def empty_shard(self, unit: ParamUnit) -> torch.Tensor:
        """A buffer for ``unit``'s shard; page-aligned host memory when the unit lives on the CPU."""
        if unit.device.type == "cpu" and isinstance(self.store, TensorSwapper):
            return aligned_empty(unit.shard_numel, unit.dtype)
        return torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)

    def write(self, unit: ParamUnit, shard: torch.Tensor) -> None:
        """Store ``shard`` (blocking: the caller frees it right after)."""
        host = shard if shard.device.type == "cpu" or isinstance(self.store, HostStore) else shard.to("cpu")
        self.store.swap_out(self.key(unit), host).wait()

    def read(self, unit: ParamUnit, out: torch.Tensor) -> None:
        """Fill ``out`` with ``unit``'s stored shard (blocking)."""
        if out.device.type == "cpu" or isinstance(self.store, HostStore):
            self.store.swap_in(self.key(unit), out).wait()
            return
        host = torch.empty(out.numel(), dtype=out.dtype)
        self.store.swap_in(self.key(unit), host).wait()
        out.copy_(host)

    def close(self) -> None:
        """Release the store (for NVMe: delete this rank's swap directory)."""
        self.store.close()


def stand_in(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A storage-less 1-D tensor of ``numel`` elements of ``like``'s dtype and device (one element, stride 0): an
    optimizer key and ``.grad`` holder whose values live elsewhere. Writing to it raises, so a missed
    ``ShardSlices.open`` fails loudly instead of updating nothing."""
    return torch.zeros(1, dtype=like.dtype, device=like.device).expand(numel)


class ShardSlices:
    """``SteppedAccess`` (offload/stepped_access.py) for fp32 ZeRO-3 with offloaded shards: stand-in → (unit, range
    of its shard). Tensors it does not know (those of units that stay in memory) hold their values themselves."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[ParamUnit, int, int]] = {}

    def add(self, tensor: torch.Tensor, unit: ParamUnit, start: int, end: int) -> None:
        self._where[id(tensor)] = (unit, start, end)

    def open(self, tensor: torch.Tensor, writing: bool) -> torch.Tensor:
        where = self._where.get(id(tensor))
        if where is None:
            return tensor.view(-1)
        unit, start, end = where
        if writing:
            shard = unit.writable_shard(keep_values=True)  # a tensor may cover only part of the shard
        else:
            unit.fetch_shard()
            shard = unit.shard
        return shard[start:end]

    def close(self, tensor: torch.Tensor) -> None:
        where = self._where.get(id(tensor))
        if where is not None:
            where[0].evict_shard()  # writes it back if it was opened for writing


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
) -> ParamOffloader:
    """The store for ``units``' shards; collective over the data-parallel ranks (``agree`` all-gathers a small
    object), so an ``nvme_path`` unusable on one rank fails every rank at once and leaves no directories."""
    if device == "cpu":
        return ParamOffloader(HostStore(pin_memory), device)
    if device != "nvme":
        raise ValueError(f"offload_param.device = {device!r}; valid: none, cpu, nvme")
    if not nvme_path:
        raise ConfigError('zero_optimization.offload_param.device = "nvme" needs "nvme_path": a writable directory')
    sizes = [unit.shard_numel * unit.shard.element_size() for unit in units]
    swapper = open_swapper_on_every_rank(
        nvme_path,
        lambda: max(TensorSwapper.bytes_needed(sizes, settings), 1),
        settings,
        key="zero_optimization.offload_param.nvme_path",
        job_prefix="shardspeed-params",
        rank=rank,
        agree=agree,
    )
    return ParamOffloader(swapper, device)
