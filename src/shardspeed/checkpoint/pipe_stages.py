"""Checkpoints of a model split into pipeline stages: what changes when ranks hold *different* parameters.

[Note: checkpoints across pipeline degrees] A pipeline stage holds only its layers, under the names the whole
model gives them (a ``PipelineModule`` keeps each layer's global index in its parameter names, tied weights under
``tied_modules.<key>.``), so a checkpoint is the same set of named tensors whatever the stage count: each stage
writes the parameters it holds, and a load at any pipeline degree reads each parameter it holds by name from
whichever stage wrote it. Four things assumed that every rank holds the whole model:
- a weight tied across stages (the embedding and the LM head) is one parameter with a copy on each stage holding
  it: only its owner (the lowest such stage) writes it (``ParamSpecs.tied_copies`` names the others' copies), and
  a load fills every copy from that one record, since the copies share the owner's name;
- a persistent buffer held by several stages (a tied module's) is kept from the lowest global rank writing it
  (``dedupe_buffer_records``; buffers are small, the other copy's chunk stays unreferenced in its file);
- the metadata's per-parameter layouts and tied aliases are each rank's own: they are merged over the world
  (``merge_rank_maps``), so the metadata describes the whole model;
- a strict load checks that *this rank's* names are all in the checkpoint, and that every checkpoint name is held
  by *some* rank (``names_held_anywhere``, one all-gather over the world, only with a pipe axis): a name another
  stage holds is not unexpected; ``engine.load_state_dict`` likewise.
``module_state_dict`` / ``state_dict`` / ``save_16bit_model`` give the whole model: each stage's dense state dict
(ZeRO-3 gathered, tensor slices assembled) is completed with the other stages' over the pipe axis
(``add_other_stages``), so every rank holds the whole model and global rank 0 writes one file. DeepSpeed writes one
file per layer from each stage instead (``layer_XX-model_states.pt``); one file loads into any pipeline degree, or
none, without a converter.
Nothing here runs without a pipe axis, so DP/TP checkpoints are written and checked exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardspeed.engine import ShardSpeedEngine


def pipelined(engine: ShardSpeedEngine) -> bool:
    """Whether stages hold different parameters (decided from the topology: every rank takes the same branch)."""
    return engine.topology.pipe.size > 1


def dedupe_buffer_records(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """Every rank's chunk records (``per_rank[r]``: global rank r's), with each ``buffer/`` tensor kept only from
    the lowest rank that wrote it: stages holding one tied module both write its buffers."""
    first_writer: dict[str, int] = {}
    out: list[Mapping[str, Any]] = []
    for rank, records in enumerate(per_rank):
        for record in records:
            name = record["name"]
            if name.startswith("buffer/") and first_writer.setdefault(name, rank) != rank:
                continue
            out.append(record)
    return out


def merge_rank_maps(per_rank: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Union of per-rank dicts by key, first rank first (layouts and aliases are the same wherever a name repeats:
    the structure check compared the ranks of each stage, and a tied copy has its owner's shape)."""
    out: dict[str, Any] = {}
    for mapping in per_rank:
        for key, value in (mapping or {}).items():
            out.setdefault(key, value)
    return out


def names_held_anywhere(engine: ShardSpeedEngine, mine: set[str]) -> set[str] | None:
    """The union over the world of every rank's parameter names (collective over the world; every rank calls it);
    None without a pipe axis, where every rank holds the same names."""
    if not pipelined(engine):
        return None
    everyone = engine.collectives.all_gather_object(sorted(mine), engine.topology.world)
    return {name for names in everyone for name in names}


def add_other_stages(engine: ShardSpeedEngine, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (this stage's dense state dict) completed in place with every other stage's entries, so each rank
    holds the whole model's state dict (collective over the pipe axis; every rank calls it). A name several stages
    hold (a tied weight) keeps this stage's tensor, which equals the owner's. Other stages' tensors arrive through
    one ``all_gather_object`` (host copies, names sharing a tensor still share one) and are moved to this rank's
    device; the whole model is then in memory on every rank, as ``module_state_dict`` is without a pipe axis."""
    host: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().to("cpu")
        host[name] = copies[id(tensor)]
    device = next((t.device for t in state.values()), torch.device("cpu"))
    everyone = engine.collectives.all_gather_object(host, engine.topology.pipe)
    for stage, theirs in enumerate(everyone):
        if stage == engine.topology.pipe.rank:
            continue
        moved: dict[int, torch.Tensor] = {}
        for name, tensor in theirs.items():
            if name not in state:
                state[name] = moved.setdefault(id(tensor), tensor.to(device))
    return state
