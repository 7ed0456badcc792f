"""``offload_param`` from the first unit on: the parameter store is opened before any unit has values.

[Note: offload during construction] Offloading parameters bounds host memory only if no moment holds every
shard. Opening the store after the stage was built (materialize every unit, shard it, *then* move the shards)
would keep all of this rank's shards in memory at once — 4Ψ/N bytes in fp32 — so the whole-run peak would grow
with the model even though training does not. The store only needs each unit's shard *size*, which the unit plan
fixes before any value exists (a meta parameter has its shape and dtype), so ``Stage3States`` opens it first
(``OpenParamOffload`` over ``unit_shapes``; collective, symmetric across the data-parallel ranks exactly as
before: a swap-file problem is one agreed error on every rank) and hands each unit's shard to it as soon as the
unit is sharded — after zero.Init's replay, the tensor-replica sync and the data-axis broadcast of that unit —
freeing the shard (``ParamUnit.start_offload``). So during construction at most the open unit's buffer, its shard
and the materializer's spare buffer are in memory, whatever the model's size. The stage's later bookkeeping
never needs the values: fp32 stepped tensors of an offloaded unit are stand-ins from the start, the optimizer
seeds its store through ``stepped_access`` (one unit's shard resident at a time). Mixed precision: when a
streamed offload optimizer will hold the fp32 masters (``engine_setup.masters_go_to_optimizer``) the stage never
builds them — its stepped tensors are fp32 stand-ins from the start and the optimizer seeds from the low-precision
shards, upcast one unit at a time; otherwise the masters are built from each shard read back one unit at a time
and stay in memory by design (4Ψ/N: the masters', not construction's). A model built normally and then wrapped
already holds its full parameters in the user's memory; the engine adds one unit's shard at a time on top, not all
of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardspeed.zero.layout import padded_size
from shardspeed.zero.stage3.plan import PERSISTENT, UnitPlan

if TYPE_CHECKING:
    from shardspeed.zero.stage3.param_offload import ParamOffloader


@dataclass(frozen=True)
class UnitShape:
    """What the parameter store needs to know of a unit before it exists (the ``ParamUnit`` fields it reads)."""

    index: int
    name: str
    names: tuple[str, ...]
    numel: int  # unpadded elements of the whole unit
    shard_numel: int  # elements of each rank's shard (padded)
    dtype: torch.dtype
    device: torch.device


OpenParamOffload = Callable[[Sequence[UnitShape]], "ParamOffloader"]
"""Opens the parameter store for the non-persistent units described (collective over the data axis)."""


def unit_shapes(
    plan: UnitPlan,
    ordered_names: Sequence[Sequence[str]],
    params: Mapping[str, torch.nn.Parameter],
    world: int,
    device: torch.device | None,
) -> list[UnitShape]:
    """The non-persistent units of ``plan`` (parameters in ``ordered_names``' order, looked up in ``params``, meta
    or not) as the store sees them once sharded over ``world`` ranks; pure. ``device``: where shards will live
    (None: the first parameter's device, as ``ParamUnit`` decides)."""
    shapes = []
    for index, (spec, names) in enumerate(zip(plan.units, ordered_names)):
        if spec.name == PERSISTENT or not names:
            continue
        first = params[names[0]]
        numel = sum(params[n].numel() for n in names)
        shapes.append(
            UnitShape(
                index,
                spec.name,
                tuple(names),
                numel,
                padded_size(numel, world) // world,
                first.dtype,
                device if device is not None else first.device,
            )
        )
    return shapes
