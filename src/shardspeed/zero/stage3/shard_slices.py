"""``ShardSlices``: where the streamed optimizer finds the values of ZeRO-3 stand-ins whose unit shards are
offloaded (``offload_param``, param_offload.py), one unit's shard in memory at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shardspeed.zero.stage3.unit import ParamUnit


class ShardSlices:
    """``SteppedAccess`` (offload/stepped_access.py) for ZeRO-3 stand-ins (fp32 with offloaded shards, or mixed
    precision whose masters the streamed optimizer holds): stand-in → (unit, range
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
