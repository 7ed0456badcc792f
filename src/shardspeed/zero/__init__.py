"""ZeRO: model states by stage. `build_model_states` picks the implementation for a config's stage."""

from __future__ import annotations

import torch

from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.layout import build_shard_layout
from shardspeed.zero.param_groups import PackedParams
from shardspeed.zero.states import ModelStates


def build_model_states(
    stage: int, packed: PackedParams, bucket_numel: int, ctx: CommContext, device: torch.device, overlap: bool = True
) -> ModelStates:
    from shardspeed.zero.partitioned import PartitionedStates
    from shardspeed.zero.replicated import ReplicatedStates

    world = ctx.axis.size if stage > 0 else 1
    layout = build_shard_layout([p.numel() for p in packed.params], packed.groups, bucket_numel, world)
    if stage == 0:
        return ReplicatedStates(packed, layout, ctx, device, overlap)
    if stage in (1, 2):
        return PartitionedStates(stage, packed, layout, ctx, device, overlap)
    raise ValueError(f"ZeRO stage {stage} is not implemented")
