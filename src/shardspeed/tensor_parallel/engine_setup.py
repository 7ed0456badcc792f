"""The engine's construction-time steps that a tensor axis changes: the parameter specs and the structure check
agreed over the whole world, and the initial broadcast over the data *and* tensor axes.

[Note: structure check over the world] Ranks of one tensor group hold different local shapes (uneven slices:
ceil chunks), so comparing local shapes would fail on a correct model; comparing over the data axis alone would let
a model that differs between tensor ranks go on into mismatched collectives (a hang, or silently mixed tensors).
So the fingerprint is of *global* shapes (``engine.param_specs``) and is compared over ``topology.world`` (among
the ranks of each pipeline stage: stages hold different layers). The spec
collection itself can fail on one rank only (a local shape its spec does not give); its error travels in the
gathered fingerprint, so that rank's error is raised on every rank instead of leaving the others in the gather.

[Note: replicas under zero.Init] A model built under ``zero.Init`` has no values when the engine starts, so
``broadcast_initial_state`` skips its meta tensors and stage 3 materializes them unit by unit, broadcasting each
unit over the *data* axis only. The tensor axis is covered by ``tensor_replica_sync``: materialization calls it on
each unit's freshly initialized, still whole parameters (and each module's new buffers) *before* the data-axis
broadcast, and it broadcasts the tensor-replicated ones (per ``engine.param_specs``: undeclared, or declared
unpartitioned) from tensor rank 0 over the tensor axis. Bounded: one unit is whole at a time, as without TP. So
every replica ends up as global rank 0's (tensor rank 0 of data rank 0), exactly as for a normally built model.
Partitioned parameters keep their own slice. What "the model" is when ranks were seeded differently: TP layers
draw the *global* init from the generator and keep their slice, so slices from different seeds come from
different global draws — the result is consistent (replicas equal, training well defined) but is no single seed's
model. DeepSpeed and Megatron require the same seed on every tensor rank for the model to equal a dense one;
so does shardspeed for dense parity — the broadcast only guarantees that replicas can never diverge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardspeed.comm import Collectives
from shardspeed.faults.errors import mark_agreed
from shardspeed.params import ParamSpecs
from shardspeed.symmetric import raise_if_different
from shardspeed.topology import AxisGroup, Topology

__all__ = ["broadcast_initial_state", "collect_specs_agreed", "global_fingerprint", "tensor_replica_sync"]

ReplicaEntries = list[tuple[str, torch.Tensor, torch.Tensor]]


def global_fingerprint(module: nn.Module, specs: ParamSpecs) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, *global* shape, dtype, requires_grad) for every parameter and buffer, in registration order: equal
    on every rank of a correct tensor-parallel model, whatever its tensor rank's slice."""
    entries = [
        (n, tuple(specs.of(p, n).global_shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()
    ]
    entries += [(n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return entries


def collect_specs_agreed(model: nn.Module, topology: Topology, collectives: Collectives) -> ParamSpecs:
    """``ParamSpecs.collect`` for this tensor rank, then the model structure (global shapes) checked identical over
    the world ([Note: structure check over the world]). Collective over the world; raises the same error on every
    rank."""
    specs: ParamSpecs | None = None
    try:
        specs = ParamSpecs.collect(model, topology.tensor.rank, topology.tensor.size)
        mine: Any = global_fingerprint(model, specs)
    except (TypeError, ValueError) as exc:
        if topology.world.size == 1:
            raise
        mine = f"{type(exc).__name__}: {exc}"
    if topology.world.size > 1:
        # Pipeline stages hold different layers: each stage's fingerprint is compared among the ranks of that
        # stage only, but the gather is world-wide so every rank raises the same error.
        everyone = collectives.all_gather_object((topology.pipe.rank, mine), topology.world)
        for index, (_, other) in enumerate(everyone):
            if isinstance(other, str):
                raise mark_agreed(
                    ValueError(f"model structure on rank {topology.world.ranks[index]} (its parameter specs): {other}")
                )
        for stage in sorted({s for s, _ in everyone}):
            members = [i for i, (s, _) in enumerate(everyone) if s == stage]
            what = "model structure" if topology.pipe.size == 1 else f"model structure of pipeline stage {stage}"
            axis = AxisGroup(topology.world.name, None, tuple(topology.world.ranks[i] for i in members), 0)
            raise_if_different([everyone[i][1] for i in members], axis, what=what)
    assert specs is not None
    return specs


@torch.no_grad()
def broadcast_initial_state(module: nn.Module, specs: ParamSpecs, topology: Topology, collectives: Collectives) -> None:
    """Every rank starts from the same replicas: all parameters and buffers from data-parallel rank 0 over the data
    axis (as DeepSpeed does), and those replicated over the tensor axis (undeclared, or declared unpartitioned in
    ``specs``) from tensor rank 0 over the tensor axis, so a model seeded differently per rank still starts with
    identical replicas. Partitioned parameters keep their own slice. Meta tensors (``zero.Init``) are skipped:
    stage 3 broadcasts each unit as it materializes it."""
    named = [*module.named_parameters(), *module.named_buffers()]
    for _, tensor in named:
        if not tensor.is_meta:
            collectives.broadcast(tensor.data, topology.data, 0, tag="init")
    if topology.tensor.size == 1:
        return
    for name, tensor in named:
        if tensor.is_meta:
            continue
        if specs.of(tensor, name).partitioned:
            continue
        collectives.broadcast(tensor.data, topology.tensor, 0, tag="init.tensor")


def tensor_replica_sync(
    specs: ParamSpecs, topology: Topology, collectives: Collectives
) -> Callable[[ReplicaEntries], None] | None:
    """What zero.Init's materialization calls on each unit's (name, tensor the specs know, value) before sharding
    it: tensor-replicated values broadcast from tensor rank 0 over the tensor axis ([Note: replicas under
    zero.Init]). None without a tensor axis. Every rank decides from the agreed specs, so the calls match."""
    if topology.tensor.size == 1:
        return None

    @torch.no_grad()
    def sync(entries: ReplicaEntries) -> None:
        for name, known, value in entries:
            if not specs.of(known, name).partitioned:
                collectives.broadcast(value, topology.tensor, 0, tag="init.tensor")

    return sync
