"""What the engine's checkpoints are made of, shared by saving (engine_io.py) and loading (load_plan.py): the
pieces a rank holds, their values brought into memory while used, the persistent buffers, the optimizer's name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardspeed.checkpoint.pieces import Piece

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
