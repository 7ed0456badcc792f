"""Whole values of one parameter, whatever the ZeRO stage: read, assembled and written back through checkpoint pieces.

[Note: parameter access through pieces] Every stage already describes what a rank holds of each parameter as
``Piece``s (checkpoint/pieces.py): "elements [start, end) of parameter ``name`` are in this fp32 view; their
optimizer state is at ``opt_offset`` of ``opt_tensor``", and ``opt_tensor.grad`` is that tensor's reduced
gradient. That one description serves ``engine.load_state_dict`` and DeepSpeed's ``safe_get_full_*`` /
``safe_set_full_*`` (utils/safe_access.py) at every stage, with mixed precision (the pieces are the fp32 masters)
and offload (``_resident`` brings offloaded values in, one unit at a time), so no stage needs its own accessors.

Assembling: each rank writes the ranges it is responsible for (``Piece.write``: a replicated parameter is written by
one rank) into a zero tensor of the full size, and one all-reduce (sum) over the data axis completes it. Whether that
collective runs is decided from the stage and the parameter alone (never from what this rank happens to hold), so
every rank takes the same branch: stage 0 and parameters a stage leaves whole are read locally.
Writing: every rank is handed the full value, writes its pieces, and the stage propagates the fp32 values into the
model's parameters (copy back, or all-gather: collective at stages 1-3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.checkpoint.engine_io import _all_pieces, _resident
from shardspeed.checkpoint.pieces import Piece
from shardspeed.zero.api import full_shape

if TYPE_CHECKING:
    from shardspeed.engine import ShardSpeedEngine

__all__ = ["assemble", "canonical_names", "full_shapes", "is_replicated", "local_pieces", "write_values"]


def canonical_names(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter) → its first name (tied parameters: the name checkpoints and pieces use)."""
    return {id(p): name for name, p in module.named_parameters()}


def full_shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    """Every state-dict name of ``module`` (parameters, persistent buffers) → its whole shape (ZeRO-3 placeholders
    report their real shape)."""
    params = {name: full_shape(p) for name, p in module.named_parameters(remove_duplicate=False)}
    return {name: params.get(name, t.shape) for name, t in module.state_dict(keep_vars=True).items()}


def is_replicated(engine: ShardSpeedEngine, name: str) -> bool:
    """Whether every rank holds all of parameter ``name`` (stage 0, or a parameter the stage leaves whole). The same
    answer on every rank: it decides whether reading it is collective."""
    return engine.config.zero_optimization.stage == 0 or name not in engine.states.managed_names


def local_pieces(engine: ShardSpeedEngine, name: str) -> list[Piece]:
    """This rank's pieces of parameter ``name``, in element order (values possibly not resident: see ``_resident``)."""
    return sorted((p for p in _all_pieces(engine) if p.name == name), key=lambda p: p.start)


@torch.no_grad()
def assemble(
    engine: ShardSpeedEngine,
    name: str,
    read: Callable[[Piece], torch.Tensor | None],
    what: str,
) -> torch.Tensor:
    """The whole fp32 tensor of parameter ``name`` from ``read(piece)`` (this piece's range, 1-D; None when this
    rank has nothing to contribute there). Collective over the data axis unless the parameter is replicated.
    Raises KeyError when no rank could read anything (``what`` names it)."""
    engine.states.wait_params()  # [Note: overlapped parameter gather]: the pieces may be parameter-buffer slices
    shape = full_shapes(engine.module)[name]
    numel = math.prod(shape)
    replicated = is_replicated(engine, name)
    out = torch.zeros(numel + 1, dtype=torch.float32, device=engine.device)  # last element: pieces found
    for piece in _resident(engine, local_pieces(engine, name), writing=False):
        if not (piece.write or replicated):
            continue
        part = read(piece)
        if part is None:
            continue
        out[piece.start : piece.end] = part.float()
        out[numel] += 1
        if replicated:
            break  # whole on this rank: one piece covers it
    if not replicated:
        engine.collectives.all_reduce(out, engine.topology.data, tag="param_access")
    if out[numel].item() == 0:
        raise KeyError(f"{what} of parameter '{name}' does not exist (yet)")
    return out[:numel].view(shape)


@torch.no_grad()
def write_values(engine: ShardSpeedEngine, values: Mapping[str, torch.Tensor]) -> None:
    """Make ``values`` (canonical parameter name → whole tensor, the same on every rank) the parameters' values:
    fp32 masters and optimizer-held values first, then the model's parameters (collective at stages 1-3: every rank
    must call it with the same names)."""
    engine.states.wait_params()  # a gather landing after these writes would undo them
    pieces = [p for p in _all_pieces(engine) if p.name in values]
    for piece in _resident(engine, pieces, writing=True):
        source = values[piece.name].detach().reshape(-1)[piece.start : piece.end]
        piece.value.copy_(source.to(device=piece.value.device, dtype=piece.value.dtype))
    after_load: Any = getattr(engine.optimizer, "after_checkpoint_load", None)
    if after_load is not None:  # an offloaded optimizer keeps the fp32 values in its store: write them there
        after_load()
    engine.states.after_optimizer_step()  # push the fp32 values into the model's parameters
    engine.states.wait_params()  # whole before returning: the caller may read them directly


def piece_slice(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``piece``'s range inside ``tensor``, a tensor shaped like ``piece.opt_tensor`` (a state, a gradient)."""
    return tensor.view(-1)[piece.opt_offset : piece.opt_offset + piece.numel]
