"""save_checkpoint / load_checkpoint for the engine: every stage, any world size, no pickle.

Saving: each rank writes the parameter pieces it is responsible for (see checkpoint/pieces.py) and the
optimizer state of the same ranges into its own files under a temporary directory; one rank commits (index,
metadata, rename, then ``latest``). Loading: each rank reads, chunk by chunk, only the ranges of the pieces it
holds — whatever stage and world size wrote them — then the stage propagates the loaded fp32 values into the
model's parameters (copy back, or all-gather). Optimizer states are keyed by parameter name and element range,
so a stage-3 world-2 checkpoint resumes as stage 0 on one process, or as stage 2 on four, without conversion.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.checkpoint.agreement import agree_on_outcome, failure_of
from shardspeed.checkpoint.commit import commit_checkpoint, discard_tmp, make_tmp_dir, resolve_tag
from shardspeed.checkpoint.pieces import Piece
from shardspeed.checkpoint.rng import capture_rng, restore_rng
from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter
from shardspeed.symmetric import check_same_on_all_ranks

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


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    canonical: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name
    return aliases


def _plain(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{what} must be plain data (dicts, lists, strings, numbers, booleans, None) so checkpoints can be "
            f"loaded without unpickling: {err}"
        ) from None


def _scalar(value: Any) -> dict[str, Any] | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"value": value.item(), "tensor": True, "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (int, float, bool)):
        return {"value": value, "tensor": False}
    return None


def _per_element(key: str, value: Any, stepped: torch.Tensor) -> bool:
    """Whether optimizer state ``key`` holds one value per element of ``stepped`` (Adam's moments) rather than
    one per tensor (``step``).

    [Note: per-element vs per-tensor state] The shape tells them apart: per-element state has the stepped
    tensor's shape, per-tensor scalars are 0-dim. Counting elements does not: a 1-element shard slice's
    ``exp_avg`` has one element like ``step``, and at stage 0 a 0-dim parameter (CLIP's logit scale) is stepped
    itself, so its moments are 0-dim too. Saved as a scalar, such state loads as a 0-dim tensor into a flat
    shard slice at another stage, and the first step fails on a shape error on the ranks holding it (the others
    hang). Only for a 0-dim stepped tensor is the shape ambiguous; there ``step``, the per-tensor counter every
    torch optimizer keeps under that name, is the scalar.
    """
    if not isinstance(value, torch.Tensor) or value.shape != stepped.shape:
        return False
    return stepped.dim() > 0 or key != "step"


def save(
    engine: ShardSpeedEngine,
    save_dir: str | Path,
    tag: str | None,
    client_state: dict | None,
    save_latest: bool,
    *,
    exclude_frozen: bool = False,
) -> Path:
    """``exclude_frozen``: parameters with ``requires_grad=False`` are left out (DeepSpeed's
    ``exclude_frozen_parameters``; loading such a checkpoint needs ``load_module_strict=False``)."""
    axis, comm = engine.topology.data, engine.collectives
    tag = tag or f"global_step{engine.global_steps}"
    save_dir = Path(save_dir)
    _check_same_destination(save_dir, tag, axis, comm)
    client = _plain(client_state or {}, "client_state")
    nonce = comm.all_gather_object(uuid.uuid4().hex, axis)[0]
    what = f"save_checkpoint to {save_dir / tag}"
    records: list[dict[str, Any]] = []
    scalars: dict[str, dict[str, Any]] = {}
    failure, own = None, None
    try:  # [Note: agreed checkpoint outcomes] in agreement.py: a full disk on one rank must not hang the others
        tmp_dir = make_tmp_dir(save_dir, tag, nonce)
        records, scalars = _write_pieces(engine, tmp_dir, exclude_frozen)
    except Exception as error:
        failure, own = failure_of(error), error
    everything = comm.all_gather_object(
        {"records": records, "scalars": scalars, "rng": capture_rng(), "failure": failure}, axis
    )
    failures = [r["failure"] for r in everything]
    if any(f is not None for f in failures):
        if engine.topology.dp_rank == 0:
            discard_tmp(save_dir, tag, nonce)
        agree_on_outcome(failure, lambda _: failures, axis.ranks, what, own_error=own, write=True)
    failure, own = None, None
    try:
        if engine.topology.dp_rank == 0:
            _commit(engine, save_dir, tag, tmp_dir, everything, client, save_latest)
    except Exception as error:
        failure, own = failure_of(error), error
        discard_tmp(save_dir, tag, nonce)  # a commit that failed before its rename: nothing of it stays
    # nobody returns before the commit is visible, and a commit that failed fails every rank
    agree_on_outcome(failure, lambda f: comm.all_gather_object(f, axis), axis.ranks, what, own_error=own, write=True)
    return save_dir / tag


def _write_pieces(
    engine: ShardSpeedEngine, tmp_dir: Path, exclude_frozen: bool
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Write this rank's pieces (parameters, their optimizer states, rank 0's buffers) into ``tmp_dir``; returns
    the chunk records and the per-tensor optimizer scalars (``step``)."""
    writer = CheckpointWriter(tmp_dir, engine.topology.global_rank)
    scalars: dict[str, dict[str, Any]] = {}
    optimizer = engine.optimizer
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    for piece in _resident(engine, [p for p in _all_pieces(engine) if p.name not in frozen], writing=False):
        if not piece.write:
            continue
        writer.add(f"param/{piece.name}", piece.full_shape, piece.start, piece.value.detach().contiguous())
        if piece.opt_tensor is None:
            continue
        states = optimizer.state.get(piece.opt_tensor, {}) if optimizer is not None else {}
        for key, value in states.items():
            if _per_element(key, value, piece.opt_tensor):
                part = value.view(-1)[piece.opt_offset : piece.opt_offset + piece.numel]
                writer.add(f"optim/{piece.name}/{key}", piece.full_shape, piece.start, part.detach().contiguous())
            elif (scalar := _scalar(value)) is not None:
                scalars.setdefault(piece.name, {})[key] = scalar
    if engine.topology.dp_rank == 0:
        for name, buf in _persistent_buffers(engine.module):
            writer.add(f"buffer/{name}", tuple(buf.shape), 0, buf.detach().reshape(-1).contiguous())
    return writer.finish(), scalars


def _commit(
    engine: ShardSpeedEngine,
    save_dir: Path,
    tag: str,
    tmp_dir: Path,
    everything: list[dict[str, Any]],
    client: Any,
    save_latest: bool,
) -> None:
    """Data-parallel rank 0: the metadata, then ``commit_checkpoint`` (a failed commit leaves no ``.tmp-`` dir)."""
    optimizer = engine.optimizer
    merged_scalars: dict[str, dict[str, Any]] = {}
    for r in everything:
        merged_scalars.update(r["scalars"])
    loader = engine.training_dataloader
    metadata = {
        "format": FORMAT,
        "version": 1,
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
        },
        "zero_stage": engine.config.zero_optimization.stage,
        "dp_world_size": engine.topology.data.size,
        "compute_dtype": str(engine.config.compute_dtype).removeprefix("torch."),
        "optimizer_class": _optimizer_name(optimizer) if optimizer is not None else None,
        "param_groups": [_plain_group(g) for g in optimizer.param_groups] if optimizer is not None else [],
        "optimizer_scalars": merged_scalars,
        "lr_scheduler": _plain(engine.lr_scheduler.state_dict(), "the LR scheduler's state")
        if engine.lr_scheduler is not None
        else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "data_loader": _plain(loader.state_dict(), "the data loader's state") if loader is not None else None,
        "rng": [r["rng"] for r in everything],
        "client_state": client,
        "tied": _aliases(engine.module),
    }
    records_all = [rec for r in everything for rec in r["records"]]
    commit_checkpoint(save_dir, tag, tmp_dir, records_all, metadata, save_latest)


def _check_same_destination(save_dir: Path, tag: str, axis: Any, comm: Any) -> None:
    """Raise the same ValueError on every rank unless all ranks save to one directory under one tag.

    [Note: one checkpoint directory] Every rank writes its pieces into ``save_dir/.tmp-<tag>-<nonce>`` and one rank
    commits that directory, so ranks that pass different ``save_dir`` values leave the committing rank looking for
    files that were written elsewhere; it used to fail deep in the commit, with a hint about
    ``CheckpointWriter.finish()`` instead of the paths. One all-gather of (directory, tag) before anything is written
    names both paths, on every rank (no rank is left waiting in a collective the others skipped). Paths are
    compared made absolute, not resolved: two spellings of one shared directory (a relative path, a symlink) are
    the same only if they look the same, which keeps the check free of file-system calls and a mismatch explicit.
    """
    here = (str(Path(save_dir).absolute()), tag)
    everyone = comm.all_gather_object(here, axis)
    for index, (other_dir, other_tag) in enumerate(everyone):
        first_dir, first_tag = everyone[0]
        if other_dir != first_dir:
            raise ValueError(
                f"save_checkpoint: data-parallel ranks {axis.ranks[0]} and {axis.ranks[index]} passed different "
                f"directories ({first_dir!r} vs {other_dir!r}); every rank must pass the same save_dir, on a file "
                "system all ranks share: one rank commits the checkpoint from the pieces all ranks wrote there"
            )
        if other_tag != first_tag:
            raise ValueError(
                f"checkpoint tag differs between data-parallel ranks {axis.ranks[0]} and {axis.ranks[index]}: "
                f"{first_tag!r} vs {other_tag!r}"
            )


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    name = getattr(optimizer, "optimizer_class_name", None) or type(optimizer).__name__  # offload wrappers
    return "Lamb" if name == "ShardedLamb" else name


def _plain_group(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        try:
            out[k] = json.loads(json.dumps(list(v) if isinstance(v, tuple) else v))
        except (TypeError, ValueError):
            continue  # e.g. a tensor lr: restored from the scheduler instead
    return out


def load(
    engine: ShardSpeedEngine,
    load_dir: str | Path,
    tag: str | None,
    *,
    strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    custom_load_fn: Any = None,
) -> tuple[Path | None, dict | None]:
    axis, comm = engine.topology.data, engine.collectives
    load_dir = Path(load_dir)
    if tag is None and not (load_dir / "latest").exists():
        engine.logger.warning("no checkpoint to load: %s has no 'latest' file", load_dir)
        check_same_on_all_ranks(None, axis, comm, what="checkpoint tag")
        return None, None
    what = f"load_checkpoint from {load_dir}"
    gather = lambda found: comm.all_gather_object(found, axis)  # noqa: E731
    failure, own, plan = None, None, None
    try:  # everything that can find a damaged checkpoint, before anything changes: [Note: agreed checkpoint outcomes]
        plan = _open_and_verify(engine, load_dir, tag, strict, load_optimizer_states, load_module_only, custom_load_fn)
    except Exception as error:
        failure, own = failure_of(error), error
    agree_on_outcome(failure, gather, axis.ranks, what, own_error=own)
    assert plan is not None
    reader, meta, tag = plan.reader, plan.meta, plan.tag
    try:
        check_same_on_all_ranks(tag, axis, comm, what="checkpoint tag")
        failure, own = None, None
        try:
            _read_into_engine(engine, plan)
        except Exception as error:  # verified data failed to read after all (the file changed meanwhile?)
            failure, own = failure_of(error), error
        partly = f"{what} (after verification: the state is partly loaded)"
        agree_on_outcome(failure, gather, axis.ranks, partly, own_error=own)
        # Evidence that each rank read only what it holds (tests assert it; useful when tuning chunk sizes).
        engine.last_load_stats = {"files_opened": reader.files_opened, "chunks_read": reader.chunks_read}
    finally:
        reader.close()
    custom_src = plan.custom_src
    after_load = getattr(engine.optimizer, "after_checkpoint_load", None)
    if after_load is not None:  # offloaded optimizer: write the loaded values and states back to its store
        after_load()
    engine.states.after_optimizer_step()  # push the loaded fp32 values into the model's parameters
    engine.states.zero_grads()
    if custom_load_fn is not None:
        from shardspeed.engine_module import apply_custom_load

        apply_custom_load(engine, custom_src or {}, custom_load_fn)
    if not load_module_only:
        _restore_training_state(engine, meta, load_lr_scheduler_states)
    return load_dir / tag, meta.get("client_state")


@dataclass
class _LoadPlan:
    """What a load reads, found and verified before the engine's state changes."""

    tag: str
    reader: CheckpointReader
    meta: dict[str, Any]
    pieces: list[Piece]
    with_optimizer: bool
    optim_keys: dict[str, list[str]]
    custom_src: dict[str, torch.Tensor] | None


def _open_and_verify(
    engine: ShardSpeedEngine,
    load_dir: Path,
    tag: str | None,
    strict: bool,
    load_optimizer_states: bool,
    load_module_only: bool,
    custom_load_fn: Any,
) -> _LoadPlan:
    """Resolve the tag, open the checkpoint, check it fits the model, and verify every chunk this rank will read
    (file present, not truncated, crc32), so a damaged checkpoint fails before any value is overwritten."""
    tag = resolve_tag(load_dir, tag)
    reader = CheckpointReader(load_dir / tag)
    try:
        meta = reader.metadata
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{load_dir / tag} is not a shardspeed checkpoint (metadata format {meta.get('format')!r})"
            )
        pieces = _all_pieces(engine)
        model_names = engine.states.managed_names | {n for n, _ in engine.module.named_parameters()}
        _check_names(reader, pieces, model_names, strict, load_dir / tag)
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
            reader.verify_range(f"param/{piece.name}", piece.start, piece.end)
            if with_optimizer and piece.opt_tensor is not None:
                for key in optim_keys.get(piece.name, []):
                    reader.verify_range(f"optim/{piece.name}/{key}", piece.start, piece.end)
        for name, _ in _persistent_buffers(engine.module):
            if reader.has(f"buffer/{name}"):
                reader.verify_range(f"buffer/{name}", 0, reader.numel(f"buffer/{name}"))
        custom_src = _module_state_dict(reader, meta) if custom_load_fn is not None else None
    except BaseException:
        reader.close()
        raise
    return _LoadPlan(tag, reader, meta, pieces, with_optimizer, optim_keys, custom_src)


def _read_into_engine(engine: ShardSpeedEngine, plan: _LoadPlan) -> None:
    """Fill this rank's pieces (values, optimizer states), buffers and param-group settings from the checkpoint."""
    reader, meta = plan.reader, plan.meta
    with torch.no_grad():
        for piece in _resident(engine, plan.pieces, writing=True):
            entry = f"param/{piece.name}"
            if not reader.has(entry):
                continue
            reader.read_range_into(entry, piece.start, piece.value)
            if plan.with_optimizer and piece.opt_tensor is not None:
                scalars = meta["optimizer_scalars"].get(piece.name, {})
                _load_optimizer_piece(engine.optimizer, reader, piece, plan.optim_keys.get(piece.name, []), scalars)
        for name, buf in _persistent_buffers(engine.module):
            if reader.has(f"buffer/{name}"):
                buf.copy_(reader.read_full(f"buffer/{name}", dtype=buf.dtype).view_as(buf))
    if plan.with_optimizer:
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})


def _module_state_dict(reader: CheckpointReader, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
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


def _check_names(
    reader: CheckpointReader, pieces: list[Piece], model_names: set[str], strict: bool, where: Path
) -> None:
    """Shapes of what this rank holds must match; with ``strict`` the sets of names must be equal."""
    ours = {p.name: p.full_shape for p in pieces}
    theirs = {n.removeprefix("param/") for n in reader.names("param/")}
    for name, shape in ours.items():
        if name in theirs and tuple(reader.shape(f"param/{name}")) != shape:
            raise ValueError(
                f"parameter '{name}' is {tuple(reader.shape(f'param/{name}'))} in checkpoint {where} but {shape} "
                "in this model"
            )
    if strict:
        missing, unexpected = sorted(model_names - theirs), sorted(theirs - model_names)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {where} does not match the model (load_module_strict=True): missing "
                f"{missing[:10]}, unexpected {unexpected[:10]}"
            )


def _load_optimizer_piece(
    optimizer: torch.optim.Optimizer, reader: CheckpointReader, piece: Piece, keys: list[str], scalars: dict[str, Any]
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
        reader.read_range_into(entry, piece.start, target)
    for key, scalar in scalars.items():
        if scalar["tensor"]:
            state[key] = torch.tensor(scalar["value"], dtype=getattr(torch, scalar["dtype"]))
        else:
            state[key] = scalar["value"]


def _restore_training_state(engine: ShardSpeedEngine, meta: dict[str, Any], load_lr_scheduler_states: bool) -> None:
    counters = meta["counters"]
    progress = engine.progress
    progress.global_steps = counters["global_steps"]
    progress.global_samples = counters["global_samples"]
    # Resuming at another world size can change gradient_accumulation_steps: keep micro-steps on a boundary.
    progress.micro_steps = counters["global_steps"] * engine.config.gradient_accumulation_steps
    progress.skipped_steps = counters["skipped_steps"]
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.loss_scaler is not None and meta.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if engine.training_dataloader is not None and meta.get("data_loader") is not None:
        engine.training_dataloader.load_state_dict(meta["data_loader"])
    rng = meta.get("rng") or []
    if rng:
        restore_rng(rng[engine.topology.global_rank] if engine.topology.global_rank < len(rng) else rng[0])
