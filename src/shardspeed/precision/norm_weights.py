"""Which gradient elements a rank counts in the global norm, and over which ranks the partial sums are added.

[Note: norm counted once] With a tensor axis a rank's gradients are pieces of the model in two ways: a
TP-partitioned parameter's local gradient holds elements no other tensor rank holds (each is counted), while a
tensor-replicated parameter (a layer norm, a row-parallel bias, anything undeclared) is held whole by every tensor
rank, identically — counting it on each of them would add it ``tp`` times. So each rank counts its partitioned
parameters and tensor rank 0 alone counts the replicated ones (``ParamSpec.counted_in_norm``); the partial sums are
then added over the *model* scope (pipe × tensor: the ranks holding different pieces of one replica) — and, where
the ZeRO stage shards the gradients over the data axis too (stages 1-3), over the data axis as well, which is one
all-reduce over the world. Every rank ends with the same float, so the overflow / non-finite verdict and the clip
coefficient are identical on every rank of the world ([Note: agreed step] in ``training/step_core.py``).

Without a tensor (or pipe) axis nothing changes: nothing is excluded, stage 0 needs no collective and the sharded
stages keep their one scalar all-reduce over the data axis.

A NaN/Inf in an *excluded* copy is not lost: replicated gradients are identical across tensor ranks (the reduced
mean of identical computations; partial ones are summed over the tensor axis first), so tensor rank 0's counted
copy carries it.

Everything here is pure (spans, names, specs, axis choice); the stages turn the runs into tensor views.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardspeed.params.spec import ParamSpecs
from shardspeed.topology import AxisGroup, Topology

__all__ = ["NormScope", "counted_runs", "counted_views", "counted_weights", "excluded_names"]


def excluded_names(specs: ParamSpecs, names: Iterable[str]) -> frozenset[str]:
    """The parameters among ``names`` this rank holds but does not count in the norm: on tensor ranks other than 0,
    every parameter that is not partitioned over the tensor axis (declared replicated, or undeclared); on every
    rank, the copies of pipeline-tied weights another stage owns ([Note: tied copies] in params/spec.py)."""
    names = list(names)
    tied = frozenset(n for n in names if n in specs.tied_copies)
    if specs.tp_rank == 0:
        return tied
    return tied | frozenset(n for n in names if not _partitioned(specs, n))


def counted_weights(specs: ParamSpecs, names: Sequence[str]) -> list[float]:
    """1.0 for each parameter of ``names`` this rank counts in Lamb's per-parameter norm table (indexed like
    ``names``), 0.0 for the others: only the tensor-replicated duplicates (tensor rank ≠ 0) are left out.

    [Note: Lamb counts tied copies] Unlike the global norm, Lamb's table is summed over the data and tensor axes
    only (``lamb_norm_axes``), never over the pipe axis: each pipeline stage needs the whole ‖w‖ and ‖update‖ of
    every parameter it holds, a tied copy included. Leaving the copy out (``excluded_names``) would zero its norms
    on the non-owner stage, its trust ratio would fall back to 1 while the owner's is ‖w‖/‖r‖, and the copies
    would drift apart after one step. The copies are equal, so both stages compute the same ratio."""
    replicated = frozenset() if specs.tp_rank == 0 else frozenset(n for n in names if not _partitioned(specs, n))
    return [0.0 if n in replicated else 1.0 for n in names]


def _partitioned(specs: ParamSpecs, name: str) -> bool:
    spec = specs.by_name(name)
    return spec is not None and spec.partitioned


def counted_runs(spans: Iterable[tuple[int, int]], window: tuple[int, int]) -> list[tuple[int, int]]:
    """The parts of ``window`` (a range of a flat buffer: a rank's shard of a bucket or unit) *not* covered by the
    excluded parameters' ``spans`` (flat-buffer ranges), as ranges relative to ``window``'s start, in order.

    Padding and gaps between parameters are kept (they hold zeros and cost nothing), so a window with no excluded
    parameter is one run and an all-excluded window none."""
    lo, hi = window
    cuts = sorted((max(a, lo), min(b, hi)) for a, b in spans if max(a, lo) < min(b, hi))
    runs, cursor = [], lo
    for a, b in cuts:
        if a > cursor:
            runs.append((cursor - lo, a - lo))
        cursor = max(cursor, b)
    if cursor < hi:
        runs.append((cursor - lo, hi - lo))
    return runs


def counted_views(
    shards: Sequence[torch.Tensor], windows: Sequence[tuple[int, int]], excluded_spans: Sequence[tuple[int, int]]
) -> list[torch.Tensor]:
    """Views of the counted elements of ``shards`` (``shards[k]`` holds flat range ``windows[k]``); the shards
    themselves when nothing is excluded (the DP-only case: no slicing at all)."""
    if not excluded_spans:
        return list(shards)
    return [s[a:b] for s, w in zip(shards, windows) for a, b in counted_runs(excluded_spans, w)]


@dataclass(frozen=True)
class NormScope:
    """How one rank's stage computes its share of the global norm ([Note: norm counted once])."""

    excluded: frozenset[str] = frozenset()
    """Parameters held here but counted on another tensor rank."""
    whole_grads: AxisGroup | None = None
    """Where a stage holding whole reduced gradients (stage 0) adds its partial sum: the model scope, or None (no
    collective) when this rank holds the whole model."""
    sharded_grads: AxisGroup | None = None
    """Where a stage holding data-axis shards (stages 1-3) adds its partial sum: the data axis, or the world when a
    model scope exists too (one all-reduce). None: the stage's own data axis (a stage built without a scope)."""

    @classmethod
    def for_topology(cls, topology: Topology, specs: ParamSpecs, names: Iterable[str]) -> NormScope:
        """The scope of ``topology``'s rank for a model whose parameters are ``names`` (canonical names)."""
        model = topology.model if topology.model.size > 1 else None
        world_or_data = topology.world if model is not None else topology.data
        return cls(excluded_names(specs, names), model, world_or_data)
