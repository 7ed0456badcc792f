"""The two halves of an engine checkpoint load: ``open_and_verify`` finds and checks everything this rank will read
before anything changes, ``read_into_engine`` then fills the engine's pieces, optimizer states and buffers.

Verifying first is what keeps a failed load from leaving half-loaded weights: a flipped byte, a truncated or
missing file fails the load (on every rank: [Note: agreed checkpoint outcomes] in agreement.py) while the
engine still holds exactly what it held before. It costs one extra pass over the chunks this rank reads (each is
checksummed once per reader; the second pass reads only the needed slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.checkpoint.box_io import LocalBoxes, read_local_into, verify_local
from shardspeed.checkpoint.commit import resolve_tag
from shardspeed.checkpoint.compression_state import verify_compression_state
from shardspeed.checkpoint.engine_pieces import (
    FORMAT,
    _all_pieces,
    _optimizer_name,
    _persistent_buffers,
    _resident,
    boxes_of,
    spec_of,
)
from shardspeed.checkpoint.pieces import Piece
from shardspeed.checkpoint.store import CheckpointReader

if TYPE_CHECKING:
    from shardspeed.engine import ShardSpeedEngine


@dataclass
class LoadPlan:
    """What a load reads, found and verified before the engine's state changes."""

    tag: str
    reader: CheckpointReader
    meta: dict[str, Any]
    pieces: list[Piece]
    with_optimizer: bool
    optim_keys: dict[str, list[str]]
    custom_src: dict[str, torch.Tensor] | None


def open_and_verify(
    engine: ShardSpeedEngine,
    load_dir: Path,
    tag: str | None,
    strict: bool,
    load_optimizer_states: bool,
    load_module_only: bool,
    custom_load_fn: Any,
    held_anywhere: set[str] | None = None,
) -> LoadPlan:
    """Resolve the tag, open the checkpoint, check it fits the model, and verify every chunk this rank will read
    (file present, not truncated, crc32), so a damaged checkpoint fails before any value is overwritten.
    ``held_anywhere``: every rank's parameter names (a pipe axis: stages hold different ones), else this rank's."""
    tag = resolve_tag(load_dir, tag)
    reader = CheckpointReader(load_dir / tag)
    try:
        meta = reader.metadata
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{load_dir / tag} is not a shardspeed checkpoint (metadata format {meta.get('format')!r})"
            )
        pieces = _all_pieces(engine)
        model_names = held_names(engine)
        shapes = {p.name: spec_of(engine, p).global_shape for p in pieces}
        _check_names(reader, shapes, model_names, strict, load_dir / tag, held_anywhere)
        # an engine without an optimizer (evaluation only) loads the module's weights; so does any engine from a
        # checkpoint such an engine saved (it holds no optimizer states)
        with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
        with_optimizer = with_optimizer and meta.get("optimizer_class") is not None
        if with_optimizer and meta["optimizer_class"] != _optimizer_name(engine.optimizer):
            raise ValueError(
                f"checkpoint {load_dir / tag} holds {meta['optimizer_class']} states but this engine uses "
                f"{_optimizer_name(engine.optimizer)}; pass load_optimizer_states=False to load only the model"
            )
        optim_keys: dict[str, list[str]] = {}
        for entry in reader.names("optim/"):
            name, _, key = entry.removeprefix("optim/").rpartition("/")
            optim_keys.setdefault(name, []).append(key)
        for piece in pieces:
            if not reader.has(f"param/{piece.name}"):
                continue
            where = (boxes_of(engine, piece)[1], piece.full_shape, piece.start, piece.end)
            verify_local(reader, f"param/{piece.name}", *where)
            if with_optimizer and piece.opt_tensor is not None:
                for key in optim_keys.get(piece.name, []):
                    verify_local(reader, f"optim/{piece.name}/{key}", *where)
        for name, _ in _persistent_buffers(engine.module):
            if reader.has(f"buffer/{name}"):
                reader.verify_range(f"buffer/{name}", 0, reader.numel(f"buffer/{name}"))
        if with_optimizer:  # [Note: error buffers in checkpoints]: this rank's rows, read after the other states
            verify_compression_state(engine, reader, meta)
        custom_src = module_state_dict(reader, meta) if custom_load_fn is not None else None
    except BaseException:
        reader.close()
        raise
    return LoadPlan(tag, reader, meta, pieces, with_optimizer, optim_keys, custom_src)


def read_into_engine(engine: ShardSpeedEngine, plan: LoadPlan) -> None:
    """Fill this rank's pieces (values, optimizer states), buffers and param-group settings from the checkpoint."""
    reader, meta = plan.reader, plan.meta
    with torch.no_grad():
        for piece in _resident(engine, plan.pieces, writing=True):
            entry = f"param/{piece.name}"
            if not reader.has(entry):
                continue
            boxes = boxes_of(engine, piece)[1]
            read_local_into(reader, entry, boxes, piece.full_shape, piece.start, piece.value)
            if plan.with_optimizer and piece.opt_tensor is not None:
                scalars = meta["optimizer_scalars"].get(piece.name, {})
                keys = plan.optim_keys.get(piece.name, [])
                _load_optimizer_piece(engine.optimizer, reader, piece, boxes, keys, scalars)
        for name, buf in _persistent_buffers(engine.module):
            if reader.has(f"buffer/{name}"):
                buf.copy_(reader.read_full(f"buffer/{name}", dtype=buf.dtype).view_as(buf))
    if plan.with_optimizer:
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})


def module_state_dict(reader: CheckpointReader, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's whole module state dict (fp32 parameters, buffers, tied names), for ``custom_load_fn``."""
    out = {}
    for entry in reader.names("param/"):
        out[entry.removeprefix("param/")] = reader.read_full(entry).view(reader.shape(entry))
    for entry in reader.names("buffer/"):
        out[entry.removeprefix("buffer/")] = reader.read_full(entry).view(reader.shape(entry))
    for alias, canonical in (meta.get("tied") or {}).items():
        if canonical in out:
            out[alias] = out[canonical]
    return out


def held_names(engine: ShardSpeedEngine) -> set[str]:
    """This rank's parameter names, as a checkpoint names them."""
    return engine.states.managed_names | {n for n, _ in engine.module.named_parameters()}


def _check_names(
    reader: CheckpointReader,
    ours: dict[str, tuple[int, ...]],
    model_names: set[str],
    strict: bool,
    where: Path,
    held_anywhere: set[str] | None = None,
) -> None:
    """Global shapes of what this rank holds must match; with ``strict`` every name this rank holds must be in the
    checkpoint and every checkpoint name held by some rank (``held_anywhere``; None: this rank's names)
    ([Note: checkpoints across pipeline degrees])."""
    theirs = {n.removeprefix("param/") for n in reader.names("param/")}
    for name, shape in ours.items():
        if name in theirs and tuple(reader.shape(f"param/{name}")) != shape:
            raise ValueError(
                f"parameter '{name}' is {tuple(reader.shape(f'param/{name}'))} in checkpoint {where} but {shape} "
                "in this model"
            )
    if strict:
        missing = sorted(model_names - theirs)
        unexpected = sorted(theirs - (model_names if held_anywhere is None else held_anywhere))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {where} does not match the model (load_module_strict=True): missing "
                f"{missing[:10]}, unexpected {unexpected[:10]}"
            )


def _load_optimizer_piece(
    optimizer: torch.optim.Optimizer,
    reader: CheckpointReader,
    piece: Piece,
    boxes: LocalBoxes,
    keys: list[str],
    scalars: dict[str, Any],
) -> None:
    assert piece.opt_tensor is not None
    if not keys and not scalars:  # no state saved for it (never stepped): nothing to load, nothing to create
        return
    state = optimizer.state[piece.opt_tensor]
    for key in keys:
        entry = f"optim/{piece.name}/{key}"
        if key not in state:
            state[key] = torch.zeros_like(piece.opt_tensor)
        target = state[key].view(-1)[piece.opt_offset : piece.opt_offset + piece.numel]
        read_local_into(reader, entry, boxes, piece.full_shape, piece.start, target)
    for key, scalar in scalars.items():
        if scalar["tensor"]:
            state[key] = torch.tensor(scalar["value"], dtype=getattr(torch, scalar["dtype"]))
        else:
            state[key] = scalar["value"]
