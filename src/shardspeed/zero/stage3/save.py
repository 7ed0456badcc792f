"""``engine.save_16bit_model``: the model's full state dict in its training dtype, as one safetensors file.

Under ZeRO-3 no rank holds the model, so the weights are gathered one unit at a time (``ParamUnit.ensure_unsharded``,
every rank takes part) and global rank 0 streams each tensor to disk as soon as its unit is whole, then the unit is
released. Streaming is possible because a safetensors file is an 8-byte header length, a JSON header with every
tensor's dtype, shape and byte range, then the raw bytes: all of which are known before any gather (shapes from
the units, dtypes from the training dtype), so the header is written first and the bytes follow in gather order.
Rank 0 therefore holds one gathered unit plus one tensor's host copy — never the output dict that
``safetensors.torch.save_file`` would need. The file is written to a temporary name and renamed when complete.

Tied parameters (one tensor under several names) are written under every name, like ``module.state_dict()``, so
``model.load_state_dict(safetensors.torch.load_file(path))`` works as is; the ``__metadata__`` entry
``shardspeed.tied`` lists each group of names that share one tensor.

Other stages hold whole parameters: rank 0 streams ``module.state_dict()``. Under tensor parallelism every
partitioned tensor is assembled over the tensor axis just before it is written (one parameter at a time; every rank
takes part, rank 0 writes), with its global shape in the header and vocabulary padding dropped, so the file is the
dense model's state dict ([Note: full weights under tensor parallelism]). Under stage 3 with
``stage3_gather_16bit_weights_on_model_save`` false nothing is written and False is returned, as in DeepSpeed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.safetensors_file import SAFETENSORS_DTYPE_CODES, SafetensorsStreamWriter
from shardspeed.tensor_parallel.full_weights import gather_global, specs_by_state_name, tensor_split
from shardspeed.zero.stage3.unit import UnitState


@dataclass(frozen=True)
class _Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _AtomicStream:
    """The shared streaming safetensors writer, into ``path.tmp`` renamed over ``path`` only when complete."""

    def __init__(self, path: Path, slots: list[_Slot], metadata: dict[str, str]) -> None:
        for slot in slots:
            if slot.dtype not in SAFETENSORS_DTYPE_CODES:
                raise TypeError(
                    f"save_16bit_model: tensor '{slot.name}' has dtype {slot.dtype}, which safetensors cannot store"
                )
        self.path, self._tmp = path, path.with_name(path.name + ".tmp")
        entries = [(slot.name, slot.dtype, slot.shape) for slot in slots]
        # keys follow the gather order (unit by unit), not dtype size, so alignment cannot be guaranteed
        self._writer = SafetensorsStreamWriter(self._tmp, entries, metadata, require_alignment=False)
        self._names = iter([slot.name for slot in slots])

    def write(self, tensor: torch.Tensor) -> None:
        self._writer.write(next(self._names), tensor.detach().to("cpu").contiguous().reshape(-1))

    def close(self) -> None:
        self._writer.close(fsync=True)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._writer.abort()


def save_16bit_model(
    engine: Any,
    save_dir: str | os.PathLike[str],
    save_filename: str = "pytorch_model.safetensors",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the full model (training dtype) to ``save_dir/save_filename`` from global rank 0. Collective under
    ZeRO-3: every rank must call it. True when written (on every rank); False under stage 3 without
    ``stage3_gather_16bit_weights_on_model_save``."""
    engine.states.wait_params()  # [Note: overlapped parameter gather] in zero/param_gather.py
    zero = engine.config.zero_optimization
    writer_rank = engine.topology.global_rank == 0
    path = Path(save_dir) / save_filename
    if zero.stage == 3 and not zero.gather_16bit_weights_on_model_save:
        if writer_rank:
            engine.logger.warning(
                "save_16bit_model: nothing saved to %s: under ZeRO stage 3 each rank holds only parameter shards; "
                "set zero_optimization.stage3_gather_16bit_weights_on_model_save to true to gather and save them",
                path,
            )
        return False
    if engine.topology.pipe.size > 1:  # stages hold different layers: [Note: checkpoints across pipeline degrees]
        return _save_whole_pipeline(engine, path, exclude_frozen_parameters)
    state = engine.module.state_dict(keep_vars=True)
    skipped = [name for name, t in state.items() if not isinstance(t, torch.Tensor)]
    state = {
        name: t
        for name, t in state.items()
        if isinstance(t, torch.Tensor) and not (exclude_frozen_parameters and _is_frozen(t))
    }
    if skipped and writer_rank:
        engine.logger.warning(
            "save_16bit_model: non-tensor entries not saved (safetensors holds tensors): %s", ", ".join(skipped)
        )
    units = engine.states.units if zero.stage == 3 else []
    split = specs_by_state_name(engine) if tensor_split(engine) else {}
    plan = [
        (unit, [(n, t, torch.Size(split[n][1].global_shape) if n in split else shape) for n, t, shape in entries])
        for unit, entries in _write_plan(state, units)
    ]
    # tied names of a partitioned parameter: gathered once, kept only until its last name is written
    pending: dict[str, int] = {}
    for _, entries in plan:
        for n, _, _ in entries:
            if n in split:
                pending[split[n][0]] = pending.get(split[n][0], 0) + 1
    gathered: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    stream: _AtomicStream | None = None
    if writer_rank:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            slots = [_Slot(name, t.dtype, tuple(shape)) for _, entries in plan for name, t, shape in entries]
            stream = _AtomicStream(path, slots, _metadata(state))
        except Exception as exc:  # keep taking part in the gathers; report after (see _agree)
            error = exc
    for unit, entries in plan:
        was_sharded = unit is not None and unit.state is UnitState.SHARDED
        if unit is not None:
            unit.ensure_unsharded()
        for name, tensor, _ in entries:
            if name in split:  # collective over the tensor axis: every rank, writer or not
                canonical, spec = split[name]
                if canonical not in gathered:
                    gathered[canonical] = gather_global(engine, spec, tensor)
                pending[canonical] -= 1
                tensor = gathered[canonical] if pending[canonical] else gathered.pop(canonical)
            if stream is not None and error is None:
                try:
                    stream.write(tensor)
                except Exception as exc:
                    error = exc
        if was_sharded:
            unit.release()
    if stream is not None:
        try:
            if error is None:
                stream.close()
            else:
                stream.abort()
        except Exception as exc:
            error = error or exc
    _agree(engine, error, path)
    return True


def _save_whole_pipeline(engine: Any, path: Path, exclude_frozen_parameters: bool) -> bool:
    """The whole model from every pipeline stage (``module_state_dict``: each stage gathered, then completed over
    the pipe axis), written by global rank 0 in one file."""
    state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    state = {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}
    error: BaseException | None = None
    if engine.topology.global_rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            slots = [_Slot(name, t.dtype, tuple(t.shape)) for name, t in state.items()]
            stream = _AtomicStream(path, slots, _metadata(state))
            try:
                for tensor in state.values():
                    stream.write(tensor)
                stream.close()
            except BaseException:
                stream.abort()
                raise
        except Exception as exc:
            error = exc
    _agree(engine, error, path)
    return True


Entry = tuple[str, torch.Tensor, torch.Size]


def _write_plan(state: dict[str, torch.Tensor], units: list[Any]) -> list[tuple[Any, list[Entry]]]:
    """What to write, in file order: per ZeRO-3 unit (gathered around its entries) every name of each of its
    parameters with its full shape; then everything else (buffers, whole parameters) in state-dict order."""
    names_of: dict[int, list[str]] = {}
    for name, t in state.items():
        names_of.setdefault(id(t), []).append(name)
    plan: list[tuple[Any, list[Entry]]] = []
    placed: set[str] = set()
    for unit in units:
        entries = [(n, state[n], shape) for p, shape in zip(unit.params, unit.shapes) for n in names_of.get(id(p), [])]
        if entries:
            plan.append((unit, entries))
            placed.update(n for n, _, _ in entries)
    plan.append((None, [(n, t, t.shape) for n, t in state.items() if n not in placed]))
    return plan


def _is_frozen(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad


def _metadata(state: dict[str, torch.Tensor]) -> dict[str, str]:
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    tied = [names for names in groups.values() if len(names) > 1]
    metadata = {"format": "pt"}
    if tied:
        metadata["shardspeed.tied"] = json.dumps(tied)
    return metadata


def _agree(engine: Any, error: BaseException | None, path: Path) -> None:
    """Every rank learns whether rank 0 wrote the file (one scalar all-reduce over the world: rank 0 is in only one
    tensor rank's data group), so all raise or all return."""
    flag = torch.tensor([1.0 if error is not None else 0.0], device=engine.device)
    engine.collectives.all_reduce(flag, engine.topology.world, tag="save_16bit_model")
    if error is not None:
        raise RuntimeError(f"save_16bit_model: writing {path} failed: {error}") from error
    if flag.item() > 0:
        raise RuntimeError(f"save_16bit_model: global rank 0 failed to write {path}; see its error")
