"""Weights tied across pipeline stages (``TiedLayerSpec``): which stages hold each key, their process groups.

[Note: tied weights across stages] A ``TiedLayerSpec`` key (the embedding shared with the LM head) is one model
weight held by every stage with an occurrence of the key. The copies start equal (``sync_tied_weights``: a
broadcast from the owner, the lowest such stage), get the same gradient (the engine sums the copies' gradients over
the tie group before the data-axis reduction: ``ReduceTiedGrads``) and so stay equal after every step. The norm and
checkpoints count the owner's copy only (``tied_copy_names`` → ``ParamSpecs.tied_copies``).

A tie group joins the stages holding the key *within one model replica*: same data index, same tensor index. So
there is one group per (key, data index, tensor index); ``new_group`` is collective over the whole world, hence
every rank creates every group of every key, keys sorted, (data, tensor) row-major, whether or not it belongs to
them. A key held by one stage needs no group (``AxisGroup.group`` None); neither do PP=1 models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardspeed.pipe.partition import owner_of
from shardspeed.pipe.spec import TiedLayerSpec
from shardspeed.topology import AxisGroup, Topology, rank_of

__all__ = ["TiedWeight", "first_occurrences", "tie_groups", "tie_stages"]


@dataclass(frozen=True)
class TiedWeight:
    """One tied key as this rank sees it: ``names`` (this rank's names of the tied module's trainable parameters,
    ``tied_weight_attr`` first: the whole module is shared, [Note: the whole tied module is shared] in module.py),
    ``stages`` (pipe indices holding the key, ascending), ``owner`` (= min(stages)), ``axis`` (the tie group's ranks
    in stage order with this rank's data and tensor index; ``group`` None when one stage holds the key)."""

    key: str
    names: tuple[str, ...]
    stages: tuple[int, ...]
    owner: int
    axis: AxisGroup


def tie_stages(layers: Sequence[Any], parts: Sequence[int], num_stages: int) -> dict[str, tuple[int, ...]]:
    """Pipe indices holding each tied key (keys sorted), from the layer list and partition alone (pure). Every
    occurrence of a key must name the same class and tied attributes — each stage builds the key's module from
    its own first occurrence, and the stages' copies must be the same parameters — else a ValueError naming both
    layers (raised alike on every rank, before any group exists)."""
    stages: dict[str, set[int]] = {}
    first: dict[str, tuple[int, TiedLayerSpec]] = {}
    for idx, layer in enumerate(layers):
        if not isinstance(layer, TiedLayerSpec):
            continue
        seen = first.setdefault(layer.key, (idx, layer))
        if (seen[1].typename, seen[1].tied_weight_attr) != (layer.typename, layer.tied_weight_attr):
            raise ValueError(
                f"tied key '{layer.key}': layer {idx} is {layer.typename.__name__} tying {layer.tied_weight_attr}, "
                f"layer {seen[0]} is {seen[1].typename.__name__} tying {seen[1].tied_weight_attr}: every occurrence "
                f"of a key must build the same module"
            )
        stages.setdefault(layer.key, set()).add(owner_of(idx, parts, num_stages)[0])
    return {key: tuple(sorted(stages[key])) for key in sorted(stages)}


def first_occurrences(layers: Sequence[Any]) -> dict[str, int]:
    """Each tied key's global index of first occurrence (pure): the seed of its module on every stage."""
    first: dict[str, int] = {}
    for idx, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            first.setdefault(layer.key, idx)
    return first


def tie_groups(key_stages: dict[str, tuple[int, ...]], topology: Topology) -> dict[str, AxisGroup]:
    """This rank's tie group of each key its stage holds. World-collective when any key spans several stages
    (and fewer ranks than the world): every rank creates every group in the same order."""
    shape, layout = topology.shape, topology.layout
    world_size = shape.world_size
    me = topology.global_rank
    mine: dict[str, AxisGroup] = {}
    for key, stages in key_stages.items():  # sorted by key: the same order on every rank
        name = f"tied.{key}"
        replicas = [(d, t) for d in range(shape.data) for t in range(shape.tensor)]
        rank_lists = [
            tuple(layout[rank_of({"pipe": s, "data": d, "tensor": t}, shape)] for s in stages) for d, t in replicas
        ]
        groups: list[Any]
        if len(stages) == 1:
            groups = [None] * len(rank_lists)
        elif len(stages) == world_size:
            groups = [dist.group.WORLD]
        else:
            groups = [dist.new_group(list(ranks)) for ranks in rank_lists]
        for ranks, group in zip(rank_lists, groups, strict=True):
            if me in ranks:
                mine[key] = AxisGroup(name, group, ranks, ranks.index(me))
    return mine
