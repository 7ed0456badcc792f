"""ZeRO-3's share of the global gradient norm and of the non-finite report: per-unit gradient shards cut at
parameter boundaries ([Note: norm counted once] in precision/norm_weights.py)."""

from __future__ import annotations

from collections.abc import Sequence

from shardspeed.precision.grad_norm import sum_of_squares
from shardspeed.precision.norm_weights import NormScope, counted_views
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.layout import intersect
from shardspeed.zero.stage3.grad_offload import UnitGradSink
from shardspeed.zero.stage3.grads import UnitGrads
from shardspeed.zero.stage3.unit import ParamUnit
from shardspeed.zero.states import has_nonfinite


def grad_sq_sum(
    units: Sequence[ParamUnit],
    grads: Sequence[UnitGrads],
    scope: NormScope,
    ctx: CommContext,
    sink: UnitGradSink | None = None,
) -> float:
    """Σ g² over each unit's gradient shard (tensor-replicated parameters cut out off tensor rank 0), added over
    the data axis — or the world, when the model is split over a tensor/pipe axis too — in one all-reduce. With
    gradients on NVMe (``sink``) the per-view sums were taken as each shard was written ([Note: gradients on
    NVMe])."""
    if sink is not None:
        partial = sink.sq_sum(units[0].device if units else None)
        ctx.collectives.all_reduce(partial, scope.sharded_grads or ctx.axis, tag="grad_norm")
        return partial.item()
    views = []
    for unit, g in zip(units, grads):
        if not g.trainable:
            continue
        out = [i for i in g.trainable if unit.names[i] in scope.excluded]
        spans = [(unit.offsets[i], unit.offsets[i] + unit.numels[i]) for i in out]
        views += counted_views([g.grad_shard], [(unit.rank_start, unit.rank_start + unit.shard_numel)], spans)
    partial = sum_of_squares(views, units[0].device if units else None)
    ctx.collectives.all_reduce(partial, scope.sharded_grads or ctx.axis, tag="grad_norm")
    return partial.item()


def nonfinite_grad_names(
    units: Sequence[ParamUnit], grads: Sequence[UnitGrads], sink: UnitGradSink | None = None
) -> list[str]:
    """This rank's shard of each unit's gradients, cut at parameter boundaries: the parameters with NaN/Inf (with
    gradients on NVMe, each unit's shard read back in turn)."""
    names = []
    for unit, g in zip(units, grads):
        if not g.trainable:
            continue
        shard = g.grad_shard if sink is None else sink.read_shard(unit.index)
        owned_range = (unit.rank_start, unit.rank_start + unit.shard_numel)
        for i in sorted(g.trainable):
            owned = intersect((unit.offsets[i], unit.offsets[i] + unit.numels[i]), owned_range)
            if owned is not None and has_nonfinite(shard[owned[0] - unit.rank_start : owned[1] - unit.rank_start]):
                names.append(unit.names[i])
    return names
