"""save_checkpoint / load_checkpoint for the engine: every stage, any world size and mesh, no pickle.

Saving: each rank writes the parameter pieces it is responsible for (see checkpoint/pieces.py) and the
optimizer state of the same ranges into its own files under a temporary directory, as flat ranges of boxes of the
global tensors (box_io.py: a tensor-parallel slice is a box); global rank 0 commits one checkpoint for the whole
world (index, metadata, rename, then ``latest``), every agreement running over the world. Loading: each rank
reads, chunk by chunk, only the ranges of the pieces it holds — whatever stage, world size and tensor-parallel
degree wrote them — then the stage propagates the loaded fp32 values into the model's parameters (copy back, or
all-gather). Optimizer states are keyed by parameter name and element range (of a box), so a stage-3 world-2
checkpoint resumes as stage 0 on one process, or as stage 2 on four, and a TP=2 × DP=2 one at TP=1, without
conversion.

Faults: each phase of local file work ends in one all-gather of its outcome, so a full disk while saving or a
damaged chunk while loading is the same error on every rank ([Note: agreed checkpoint outcomes] in
agreement.py); a failed save leaves ``latest`` and no temporary directory behind, and a load verifies all it
will read before it changes anything (load_plan.py).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.checkpoint.agreement import agree_on_outcome, failure_of
from shardspeed.checkpoint.box_io import write_local
from shardspeed.checkpoint.commit import commit_checkpoint, discard_tmp, make_tmp_dir
from shardspeed.checkpoint.compression_state import read_compression_state, write_compression_state
from shardspeed.checkpoint.engine_pieces import (
    FORMAT,
    _all_pieces,
    _optimizer_name,
    _persistent_buffers,
    _resident,
    boxes_of,
    writes_piece,
)
from shardspeed.checkpoint.load_plan import held_names, open_and_verify, read_into_engine
from shardspeed.checkpoint.pipe_stages import dedupe_buffer_records, merge_rank_maps, names_held_anywhere, pipelined
from shardspeed.checkpoint.rng import capture_rng, restore_rng
from shardspeed.checkpoint.store import CheckpointWriter
from shardspeed.faults.errors import mark_agreed  # same files, same model: every rank raises alike
from shardspeed.params.spec import ParamSpec
from shardspeed.symmetric import check_same_on_all_ranks
from shardspeed.tensor_parallel.random import model_rng_trackers
from shardspeed.zero.api import full_shape

if TYPE_CHECKING:
    from shardspeed.engine import ShardSpeedEngine


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
    axis, comm = engine.topology.world, engine.collectives  # one checkpoint, one commit for the whole world
    engine.states.wait_params()  # [Note: overlapped parameter gather] in zero/param_gather.py
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
    rng = capture_rng(model_rng_trackers(engine.module))  # with the model-parallel streams (checkpoint/rng.py)
    mine = {"records": records, "scalars": scalars, "rng": rng, "failure": failure}
    if pipelined(engine):  # stages hold different parameters: rank 0's own layouts are not the model's
        mine |= {"layouts": _param_layouts(engine), "tied": _aliases(engine.module)}
    everything = comm.all_gather_object(mine, axis)
    failures = [r["failure"] for r in everything]
    if any(f is not None for f in failures):
        if engine.topology.global_rank == 0:
            discard_tmp(save_dir, tag, nonce)
        agree_on_outcome(failure, lambda _: failures, axis.ranks, what, own_error=own, write=True)
    failure, own = None, None
    try:
        if engine.topology.global_rank == 0:
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
        spec, boxes = boxes_of(engine, piece)
        if not writes_piece(engine, piece, spec):
            continue
        where = (spec.global_shape, boxes, piece.full_shape, piece.start)
        write_local(writer, f"param/{piece.name}", *where, piece.value)
        if piece.opt_tensor is None:
            continue
        states = optimizer.state.get(piece.opt_tensor, {}) if optimizer is not None else {}
        for key, value in states.items():
            if _per_element(key, value, piece.opt_tensor):
                part = value.view(-1)[piece.opt_offset : piece.opt_offset + piece.numel]
                write_local(writer, f"optim/{piece.name}/{key}", *where, part)
            elif (scalar := _scalar(value)) is not None:
                scalars.setdefault(piece.name, {})[key] = scalar
    write_compression_state(engine, writer)  # per-rank error buffers of 1-bit optimizers
    if engine.topology.dp_rank == 0 and engine.topology.tp_rank == 0:
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
    """Global rank 0: the metadata, then ``commit_checkpoint`` (a failed commit leaves no ``.tmp-`` dir)."""
    optimizer = engine.optimizer
    piped = pipelined(engine)
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
        "mesh": {axis: engine.topology.shape.size(axis) for axis in ("pipe", "data", "tensor")},
        "params": merge_rank_maps([r["layouts"] for r in everything]) if piped else _param_layouts(engine),
        "compute_dtype": str(engine.config.compute_dtype).removeprefix("torch."),
        "optimizer_class": _optimizer_name(optimizer) if optimizer is not None else None,
        "param_groups": [_plain_group(g) for g in optimizer.param_groups] if optimizer is not None else [],
        "optimizer_scalars": merged_scalars,
        "lr_scheduler": _plain(engine.lr_scheduler.state_dict(), "the LR scheduler's state")
        if engine.lr_scheduler is not None
        else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "data_loader": _plain(loader.state_dict(), "the data loader's state") if loader is not None else None,
        "curriculum_legacy": c.state_dict() if (c := getattr(engine, "curriculum_scheduler_legacy", None)) else None,
        "rng": [r["rng"] for r in everything],  # by global rank: gathered over the world
        "client_state": client,
        "tied": merge_rank_maps([r["tied"] for r in everything]) if piped else _aliases(engine.module),
    }
    records_all = dedupe_buffer_records([r["records"] for r in everything])
    commit_checkpoint(save_dir, tag, tmp_dir, records_all, metadata, save_latest)


def _param_layouts(engine: ShardSpeedEngine) -> dict[str, dict[str, Any]]:
    """Per parameter: its global shape and how the saving mesh split it (for readers; loading needs only boxes)."""
    out = {}
    for name, p in engine.module.named_parameters():
        spec = engine.param_specs.by_name(name) or ParamSpec(tuple(full_shape(p)))  # ZeRO-3: not the placeholder's
        out[name] = {"global_shape": list(spec.global_shape), "partition_dim": spec.partition_dim, "parts": spec.parts}
    return out


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
            raise mark_agreed(
                ValueError(
                    f"save_checkpoint: ranks {axis.ranks[0]} and {axis.ranks[index]} passed different "
                    f"directories ({first_dir!r} vs {other_dir!r}); every rank must pass the same save_dir, on a file "
                    "system all ranks share: one rank commits the checkpoint from the pieces all ranks wrote there"
                )
            )
        if other_tag != first_tag:
            raise mark_agreed(
                ValueError(
                    f"checkpoint tag differs between ranks {axis.ranks[0]} and {axis.ranks[index]}: "
                    f"{first_tag!r} vs {other_tag!r}"
                )
            )


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
    axis, comm = engine.topology.world, engine.collectives
    engine.states.wait_params()  # a pending parameter gather landing after the load would overwrite loaded values
    load_dir = Path(load_dir)
    # Agreed before branching: a rank that sees no 'latest' (a directory that is not shared, a lagging NFS cache)
    # must not return while its peers go on into the load's collectives.
    found = tag is not None or (load_dir / "latest").exists()
    check_same_on_all_ranks(  # over the world: every rank of every axis must take the same branch
        found,
        engine.topology.world,
        comm,
        what="whether load_checkpoint's directory holds a checkpoint ('latest' or a tag)",
    )
    if not found:
        engine.logger.warning("no checkpoint to load: %s has no 'latest' file", load_dir)
        return None, None
    what = f"load_checkpoint from {load_dir}"
    gather = lambda found: comm.all_gather_object(found, axis)  # noqa: E731
    # stages hold different names: a strict load's "unexpected" is what no rank holds (collective; pipe axis only)
    anywhere = names_held_anywhere(engine, held_names(engine)) if strict else None
    failure, own, plan = None, None, None
    try:  # everything that can find a damaged checkpoint, before anything changes: [Note: agreed checkpoint outcomes]
        plan = open_and_verify(
            engine, load_dir, tag, strict, load_optimizer_states, load_module_only, custom_load_fn, anywhere
        )
    except Exception as error:
        failure, own = failure_of(error), error
    agree_on_outcome(failure, gather, axis.ranks, what, own_error=own)
    assert plan is not None
    reader, meta, tag = plan.reader, plan.meta, plan.tag
    try:
        check_same_on_all_ranks(tag, axis, comm, what="checkpoint tag")
        failure, own = None, None
        try:
            read_into_engine(engine, plan)
            if plan.with_optimizer:  # [Note: error buffers in checkpoints]
                read_compression_state(engine, reader, meta)
        except Exception as error:  # verified data failed to read after all (the file changed meanwhile?)
            failure, own = failure_of(error), error
        partly = f"{what} (after verification: the state is partly loaded)"
        # Not agreed: weights are partly overwritten, so the engine must refuse further calls (the guard fails it).
        agree_on_outcome(failure, gather, axis.ranks, partly, own_error=own, agreed=False)
        # Evidence that each rank read only what it holds (tests assert it; useful when tuning chunk sizes).
        engine.last_load_stats = {"files_opened": reader.files_opened, "chunks_read": reader.chunks_read}
    finally:
        reader.close()
    custom_src = plan.custom_src
    after_load = getattr(engine.optimizer, "after_checkpoint_load", None)
    if after_load is not None:  # offloaded optimizer: write the loaded values and states back to its store
        failure, own = None, None
        try:
            after_load()
        except Exception as error:  # e.g. a full NVMe swap disk; the all-gather below must not wait for this rank
            failure, own = failure_of(error), error
        agree_on_outcome(
            failure, gather, axis.ranks, f"{what} (writing the offload store)", own_error=own, agreed=False
        )
    engine.states.after_optimizer_step()  # push the loaded fp32 values into the model's parameters
    engine.states.wait_params()  # landed here, not by the next forward: custom_load_fn and the caller read them
    engine.states.zero_grads()
    if custom_load_fn is not None:
        from shardspeed.engine_module import apply_custom_load

        apply_custom_load(engine, custom_src or {}, custom_load_fn)
    if not load_module_only:
        _restore_training_state(engine, meta, load_lr_scheduler_states)
    return load_dir / tag, meta.get("client_state")


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
    if (curriculum := getattr(engine, "curriculum_scheduler_legacy", None)) and meta.get("curriculum_legacy"):
        curriculum.load_state_dict(meta["curriculum_legacy"])  # training/curriculum.py
    rng = meta.get("rng") or []
    if rng:
        mine = rng[engine.topology.global_rank] if engine.topology.global_rank < len(rng) else rng[0]
        restore_rng(mine, model_rng_trackers(engine.module))
