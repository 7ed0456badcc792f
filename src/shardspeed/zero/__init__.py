"""ZeRO: model states by stage. `build_model_states` picks the implementation for a config's stage."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardspeed.config import ZeroConfig
from shardspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias  # DeepSpeed's zero.TiledLinear
from shardspeed.zero.api import GatheredParameters, Init, apply, full_numel, full_shape, register_external_parameter
from shardspeed.zero.arrival_order import LayoutPlanner
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.param_groups import PackedParams
from shardspeed.zero.states import ModelStates

if TYPE_CHECKING:
    from shardspeed.zero.stage3.early_offload import OpenParamOffload
    from shardspeed.zero.stage3.materialize import SyncReplicas


def build_model_states(
    zero: ZeroConfig,
    module: torch.nn.Module,
    packed: PackedParams,
    ctx: CommContext,
    device: torch.device,
    master_dtype: torch.dtype = torch.float32,
    sync_replicas: SyncReplicas | None = None,
    open_param_offload: OpenParamOffload | None = None,
    masters_to_optimizer: bool = False,
) -> ModelStates:
    """``master_dtype``: what the optimizer steps and gradients accumulate in (fp32, or bf16 with
    ``bf16_master_weights_and_grads``; [Note: low-precision masters] in config/precision.py). A master copy is
    kept only where it differs from the parameters' dtype. ``sync_replicas``: stage 3 under zero.Init only
    (materialize.py)."""
    from shardspeed.zero.partitioned import PartitionedStates
    from shardspeed.zero.replicated import ReplicatedStates
    from shardspeed.zero.stage3.states import Stage3States

    stage, overlap = zero.stage, zero.overlap_comm
    if stage == 3:
        from shardspeed.zero.stage3.leaves import leaf_paths

        leaf = zero.leaf_module
        return Stage3States(
            module,
            dict(zip(packed.names, packed.groups)),
            ctx,
            persistence_threshold=zero.param_persistence_threshold,
            prefetch_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            reduce_bucket_numel=zero.reduce_bucket_size,
            device=device,
            leaves=leaf_paths(
                module,
                classes=leaf.classes,
                names=leaf.names,
                name_suffixes=leaf.name_suffixes,
                granularity_threshold=zero.module_granularity_threshold,
            ),
            model_persistence_threshold=zero.model_persistence_threshold,
            guard_placeholders=zero.override_module_apply,
            master_dtype=master_dtype,
            sync_replicas=sync_replicas,
            open_param_offload=open_param_offload,
            masters_to_optimizer=masters_to_optimizer,
        )
    # Stages 1/2 reduce-scatter and all-gather the same buckets (bucket-major sharding), so a bucket is bounded
    # by both sizes.
    bucket_numel = zero.reduce_bucket_size if stage == 0 else min(zero.reduce_bucket_size, zero.allgather_bucket_size)

    world = ctx.axis.size if stage > 0 else 1
    planner = LayoutPlanner(tuple(p.numel() for p in packed.params), tuple(packed.groups), bucket_numel, world)
    if stage == 0:
        return ReplicatedStates(packed, planner, ctx, device, overlap, master_dtype)
    if stage in (1, 2):
        return PartitionedStates(
            stage,
            packed,
            planner,
            ctx,
            device,
            overlap,
            master_dtype,
            module=module,
            overlap_param_gather=zero.overlap_param_gather,
        )
    raise ValueError(f"ZeRO stage {stage} is not implemented")


__all__ = [
    "GatheredParameters",
    "Init",
    "ModelStates",
    "TiledLinear",
    "TiledLinearReturnBias",
    "apply",
    "build_model_states",
    "full_numel",
    "full_shape",
    "register_external_parameter",
]
