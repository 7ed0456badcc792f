"""What the engine's checkpoints are made of, shared by saving (engine_io.py) and loading (load_plan.py): the
pieces a rank holds, their values brought into memory while used, the persistent buffers, the optimizer's name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardspeed.checkpoint.box_io import LocalBoxes, local_boxes
from shardspeed.checkpoint.pieces import Piece
from shardspeed.params.spec import ParamSpec

if TYPE_CHECKING:
    from shardspeed.engine import ShardSpeedEngine

FORMAT = "shardspeed-checkpoint"


def _all_pieces(engine: ShardSpeedEngine) -> list[Piece]:
    """The stage's pieces plus whole parameters the stage does not manage (frozen ones outside ZeRO-3)."""
    pieces = engine.states.checkpoint_pieces()
    covered = engine.states.managed_names  # on every rank, even where this rank holds no piece of a parameter
    first_rank = engine.topology.dp_rank == 0
    for name, p in engine.module.named_parameters():
        if name not in covered and p.numel() > 0:
            pieces.append(Piece(name, tuple(p.shape), 0, p.numel(), p.data.view(-1), None, 0, first_rank))
    return pieces


def _resident(engine: ShardSpeedEngine, pieces: list[Piece], writing: bool) -> Iterable[Piece]:
    """``pieces`` with their values in memory while each is used: a stage that keeps values off memory between
    uses (ZeRO-3 fp32 with offload_param) brings them in one unit at a time, and a streamed optimizer holding the
    fp32 masters (mixed precision with offload_optimizer) one stepped tensor at a time (``writing``: and each
    writes them back)."""
    from_states = getattr(engine.states, "resident_pieces", None)
    out: Iterable[Piece] = pieces if from_states is None else from_states(pieces, writing)
    from_optimizer = getattr(engine.optimizer, "resident_pieces", None)
    return out if from_optimizer is None else from_optimizer(out, writing)


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in a state dict (non-persistent ones, like cached masks, are rebuilt by the model)."""
    in_state = set(module.state_dict(keep_vars=True))
    return [(n, b) for n, b in module.named_buffers() if n in in_state]


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    name = getattr(optimizer, "optimizer_class_name", None) or type(optimizer).__name__  # offload wrappers
    return "Lamb" if name == "ShardedLamb" else name


def spec_of(engine: ShardSpeedEngine, piece: Piece) -> ParamSpec:
    """What ``piece``'s parameter is a slice of (params/spec.py); undeclared: replicated, its own shape."""
    return engine.param_specs.by_name(piece.name) or ParamSpec(piece.full_shape)


def boxes_of(engine: ShardSpeedEngine, piece: Piece) -> tuple[ParamSpec, LocalBoxes]:
    """``piece``'s spec and the boxes of the global tensor its parameter holds on this tensor rank."""
    spec = spec_of(engine, piece)
    return spec, local_boxes(spec, engine.param_specs.tp_rank, engine.param_specs.tp_size)


def writes_piece(engine: ShardSpeedEngine, piece: Piece, spec: ParamSpec) -> bool:
    """Whether this rank writes ``piece``: the stage elects one data rank (``piece.write``), of a parameter
    every tensor rank holds alike (a layer norm) tensor rank 0 writes it, and of a weight tied across pipeline
    stages its owner stage writes it ([Note: checkpoints across pipeline degrees]), so nothing is written twice."""
    if piece.name in engine.param_specs.tied_copies:
        return False
    return piece.write and (spec.partitioned or engine.param_specs.tp_rank == 0)
