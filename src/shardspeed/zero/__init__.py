"""ZeRO: model states by stage. `build_model_states` picks the implementation for a config's stage."""

from __future__ import annotations

import torch

from shardspeed.config import ZeroConfig
from shardspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias  # DeepSpeed's zero.TiledLinear
from shardspeed.zero.api import GatheredParameters, Init, full_numel, full_shape, register_external_parameter
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.layout import build_shard_layout
from shardspeed.zero.param_groups import PackedParams
from shardspeed.zero.states import ModelStates


def build_model_states(
    zero: ZeroConfig, module: torch.nn.Module, packed: PackedParams, ctx: CommContext, device: torch.device
) -> ModelStates:
    from shardspeed.zero.partitioned import PartitionedStates
    from shardspeed.zero.replicated import ReplicatedStates
    from shardspeed.zero.stage3.states import Stage3States

    stage, overlap = zero.stage, zero.overlap_comm
    if stage == 3:
        return Stage3States(
            module,
            dict(zip(packed.names, packed.groups)),
            ctx,
            persistence_threshold=zero.param_persistence_threshold,
            prefetch_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            device=device,
        )
    # Stages 1/2 reduce-scatter and all-gather the same buckets (bucket-major sharding), so a bucket is bounded
    # by both sizes.
    bucket_numel = zero.reduce_bucket_size if stage == 0 else min(zero.reduce_bucket_size, zero.allgather_bucket_size)

    world = ctx.axis.size if stage > 0 else 1
    layout = build_shard_layout([p.numel() for p in packed.params], packed.groups, bucket_numel, world)
    if stage == 0:
        return ReplicatedStates(packed, layout, ctx, device, overlap)
    if stage in (1, 2):
        return PartitionedStates(stage, packed, layout, ctx, device, overlap)
    raise ValueError(f"ZeRO stage {stage} is not implemented")


__all__ = [
    "GatheredParameters",
    "Init",
    "ModelStates",
    "TiledLinear",
    "TiledLinearReturnBias",
    "build_model_states",
    "full_numel",
    "full_shape",
    "register_external_parameter",
]
