"""The benchmark's rows: each is one way to train the same model, compared with a peer row.

A row is (name, build, peer, target). ``build(setup)`` wraps a fresh copy of the template model and returns a
``RowRun``: a ``step()`` callable that runs one full optimizer step on the fixed batch and returns the loss,
and, for shardspeed rows, the engine's ``collectives.blocked`` meter (exposed communication, comm/blocked.py).
Every row trains from identical weights on identical data with the same AdamW hyperparameters, so the rows
differ only in the training system, and their losses after the same number of steps should agree (a printed
sanity check).

The peers and issue #16's targets (row/peer step time, median of the paired per-round ratios):
stage 0 ↔ torch DDP (≤ 1.00), stage 1 ↔ torch ZeroRedundancyOptimizer (torch's own optimizer-state sharding
over DDP; ≤ 0.95), stage 2 ↔ torch DDP (≤ 1.05: gradient sharding should cost little over plain data
parallelism), stage 3 ↔ torch FSDP2 (``fully_shard`` per block, then the root; ≤ 0.80).

"Before" rows (``stage<N>_before``): the same stage with ``zero_optimization.overlap_param_gather: false`` and
``communication.collectives: "native"``, the behaviour before issue #16, timed in the same rounds as the
"after" rows so before/after is a paired comparison too.

Adding a row is one builder function and one entry in ``_ROW_LIST``; e.g. the stage-1 pair:

    def _build_zero_redundancy(setup: BenchSetup) -> RowRun:
        model = _ddp(setup)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW_PARAMS)
        return _torch_step(model, optimizer, setup)

    _shardspeed_row("stage1", "shardspeed ZeRO stage 1", 1, "zero_redundancy"),
    Row("zero_redundancy", "torch DDP + ZeroRedundancyOptimizer(AdamW)", _build_zero_redundancy, None),
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from bench_models import MODEL_SIZES, BenchSetup, make_setup  # noqa: F401  (re-exported for older scripts)
from bench_report import BEFORE_SUFFIX
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

StepFn = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class RowRun:
    """A built row: its step, and (shardspeed rows) the meter of time blocked on communication."""

    step: StepFn
    blocked: Any = None  # shardspeed.comm.blocked.BlockedTime of the row's engine; None for other libraries


# Spelled out in full so the torch rows and the config-built rows cannot drift apart through different
# defaults (shardspeed, like DeepSpeed, defaults AdamW's weight_decay differently from torch).
ADAMW_PARAMS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

# Which AdamW kernel the torch peers run (bench_engine.py --peer-adam, passed to the ranks in the environment):
# "default" = what `torch.optim.AdamW(params)` gives a torch user (the per-tensor loop on CPU); "fused" = torch's
# fused kernel, the one shardspeed's config-built AdamW runs ([Note: fused Adam by default] in optim/build.py), so
# the ratio measures the training systems alone.
PEER_ADAM_ENV = "SHARDSPEED_BENCH_PEER_ADAM"


def peer_adamw_params() -> dict[str, Any]:
    kernel = os.environ.get(PEER_ADAM_ENV, "default")
    if kernel not in ("default", "fused"):
        raise ValueError(f"{PEER_ADAM_ENV}={kernel!r}: expected 'default' or 'fused'")
    return {**ADAMW_PARAMS, **({"fused": True} if kernel == "fused" else {})}


def engine_config(
    setup: BenchSetup,
    stage: int,
    zero_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    adam_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-format config shared by shardspeed and DeepSpeed rows; ``zero_extra`` adds
    ``zero_optimization`` keys (e.g. a stage-3 persistence threshold), ``extra`` top-level sections, ``adam_extra``
    optimizer params (the before rows' ``fused: false``)."""
    adam = {**ADAMW_PARAMS, "betas": list(ADAMW_PARAMS["betas"]), **(adam_extra or {})}
    return {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": {"stage": stage, **(zero_extra or {})},
        "steps_per_print": 10**9,
        **(extra or {}),
    }


# The pre-issue-16 behaviour, for the "before" rows: parameters gathered synchronously after the step, the
# backend's native reduce-scatter / all-gather whatever their measured speed, DeepSpeed's 5e8-element buckets and
# torch's per-tensor AdamW loop.
BEFORE_ZERO: dict[str, Any] = {
    "overlap_param_gather": False,
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
}
BEFORE_EXTRA: dict[str, Any] = {"communication": {"collectives": "native"}}
BEFORE_ADAM: dict[str, Any] = {"fused": False}


def _engine_step(engine: Any, setup: BenchSetup, blocked: Any = None) -> RowRun:
    """The DeepSpeed-style loop, shared by shardspeed and DeepSpeed engines."""

    def step() -> torch.Tensor:
        loss = engine(setup.inputs, setup.targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return RowRun(step, blocked)


def _torch_step(model: nn.Module, optimizer: torch.optim.Optimizer, setup: BenchSetup) -> RowRun:
    """The plain torch loop; set_to_none is torch's default for zero_grad."""

    def step() -> torch.Tensor:
        loss = model(setup.inputs, setup.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return RowRun(step)


def _build_shardspeed(
    setup: BenchSetup,
    stage: int,
    zero_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    adam_extra: dict[str, Any] | None = None,
) -> RowRun:
    import shardspeed

    model = setup.fresh_model()
    config = engine_config(setup, stage, zero_extra, extra, adam_extra)
    engine, _, _, _ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return _engine_step(engine, setup, blocked=engine.collectives.blocked)


def _ddp(setup: BenchSetup) -> DDP:
    """DDP with default settings (what a torch user gets without tuning) on the setup's device."""
    model = setup.fresh_model()
    if setup.device.type == "cuda":
        return DDP(model, device_ids=[setup.device.index])
    return DDP(model)


def _build_ddp(setup: BenchSetup) -> RowRun:
    model = _ddp(setup)
    optimizer = torch.optim.AdamW(model.parameters(), **peer_adamw_params())
    return _torch_step(model, optimizer, setup)


def _build_zero_redundancy(setup: BenchSetup) -> RowRun:
    """torch's own stage-1 equivalent: DDP all-reduces gradients, each rank steps AdamW on its share of the
    parameters and broadcasts the result."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _ddp(setup)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **peer_adamw_params())
    return _torch_step(model, optimizer, setup)


def _fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: the demo GPT's transformer blocks (the fallback MLP's layers)."""
    for attribute in ("blocks", "layers"):
        children = getattr(model, attribute, None)
        if isinstance(children, (nn.ModuleList, nn.Sequential)):
            return list(children)
    raise TypeError(f"{type(model).__name__} has neither .blocks nor .layers; the fsdp2 row cannot wrap it")


def _build_fsdp2(setup: BenchSetup) -> RowRun:
    """torch FSDP2, the usual recipe: ``fully_shard`` each transformer block, then the root (which takes the
    embeddings, the tied head and the final norm), on a 1-D mesh over the default group (gloo on CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(setup.device.type, (dist.get_world_size(),))
    model = setup.fresh_model()
    for block in _fsdp_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **peer_adamw_params())
    return _torch_step(model, optimizer, setup)


def _build_deepspeed(setup: BenchSetup, stage: int) -> RowRun:
    try:
        import deepspeed
    except ImportError as error:  # optional: never a dependency of shardspeed
        raise RuntimeError(f"deepspeed is not installed ({error}); drop the deepspeed rows from --rows") from None
    model = setup.fresh_model()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(setup, stage)
    )
    return _engine_step(engine, setup)


def _import_shardspeed() -> None:
    from shardspeed import initialize  # noqa: F401  (a lazy export: this loads the engine and its config)


def _import_deepspeed() -> None:
    with contextlib.suppress(ImportError):  # not installed: the row's build reports it
        import deepspeed  # noqa: F401


def _import_nothing() -> None:
    """torch's own rows need nothing beyond torch, which every run has imported already."""


def deepspeed_installed() -> bool:
    """Whether deepspeed can be imported, without importing it (that alone takes seconds)."""
    return importlib.util.find_spec("deepspeed") is not None


@dataclass(frozen=True)
class Row:
    name: str
    description: str
    build: Callable[[BenchSetup], RowRun]
    peer: str | None  # the row this one's step time is divided by; None for a reference row
    optional: bool = False  # an optional row that fails to build is reported and skipped, not fatal
    # Imports the row's library. Memory runs call every row's preload before measuring, so each row's
    # process holds the same modules and import costs neither differ between rows nor count as a row's growth.
    preload: Callable[[], None] = _import_nothing
    target: float | None = None  # issue #16's bound on the median ratio row/peer (None: no target)


# Issue #16's targets, by stage: the median paired ratio to the stage's peer must be at most this.
STAGE_TARGETS: dict[int, float] = {0: 1.00, 1: 0.95, 2: 1.05, 3: 0.80}
STAGE_PEERS: dict[int, str] = {0: "ddp", 1: "zero_redundancy", 2: "ddp", 3: "fsdp2"}


def _shardspeed_row(name: str, description: str, stage: int, *, before: bool = False, **zero_extra: Any) -> Row:
    if before:
        name, description = (
            name + BEFORE_SUFFIX,
            description + " (before: no param-gather overlap, native collectives, 5e8 buckets, per-tensor AdamW)",
        )
        zero_extra = {**zero_extra, **BEFORE_ZERO}
    build = partial(
        _build_shardspeed,
        stage=stage,
        zero_extra=zero_extra or None,
        extra=BEFORE_EXTRA if before else None,
        adam_extra=BEFORE_ADAM if before else None,
    )
    return Row(name, description, build, STAGE_PEERS[stage], preload=_import_shardspeed, target=STAGE_TARGETS[stage])


def _deepspeed_row(name: str, description: str, stage: int) -> Row:
    build = partial(_build_deepspeed, stage=stage)
    peer, target = STAGE_PEERS[stage], STAGE_TARGETS[stage]
    return Row(name, description, build, peer, optional=True, preload=_import_deepspeed, target=target)


# With the default persistence threshold (1e5 elements) every tensor of the small GPT stays whole on every rank, so
# the default stage-3 row gathers nothing there; the nopersist rows partition every parameter, like FSDP2. (The
# MLP's 1024 x 1024 weights are above the threshold: its stage3 row partitions them already.)
_NOPERSIST = {"stage3_param_persistence_threshold": 0}
_NOPERSIST_TEXT = "shardspeed ZeRO stage 3, stage3_param_persistence_threshold 0"

_ROW_LIST = [
    _shardspeed_row("stage0", "shardspeed ZeRO stage 0", 0),
    _shardspeed_row("stage1", "shardspeed ZeRO stage 1", 1),
    _shardspeed_row("stage2", "shardspeed ZeRO stage 2", 2),
    _shardspeed_row("stage3", "shardspeed ZeRO stage 3 (default thresholds)", 3),
    _shardspeed_row("stage3_nopersist", _NOPERSIST_TEXT, 3, **_NOPERSIST),
    *(_shardspeed_row(f"stage{stage}", f"shardspeed ZeRO stage {stage}", stage, before=True) for stage in range(4)),
    _shardspeed_row("stage3_nopersist", _NOPERSIST_TEXT, 3, before=True, **_NOPERSIST),
    Row("ddp", "torch DistributedDataParallel", _build_ddp, None),
    Row("zero_redundancy", "torch DDP + ZeroRedundancyOptimizer(AdamW)", _build_zero_redundancy, None),
    Row("fsdp2", "torch FSDP2 (fully_shard per block, then root)", _build_fsdp2, None),
    _deepspeed_row("deepspeed0", "DeepSpeed ZeRO stage 0", 0),
    _deepspeed_row("deepspeed1", "DeepSpeed ZeRO stage 1", 1),
    _deepspeed_row("deepspeed2", "DeepSpeed ZeRO stage 2", 2),
    _deepspeed_row("deepspeed3", "DeepSpeed ZeRO stage 3", 3),
]
ROWS: dict[str, Row] = {row.name: row for row in _ROW_LIST}

DEEPSPEED_ROWS = ("deepspeed0", "deepspeed1", "deepspeed2", "deepspeed3")
PEER_ROWS = ("ddp", "zero_redundancy", "fsdp2")

# What a plain run shows (DeepSpeed's rows are added when deepspeed is available): every row but the DeepSpeed ones.
DEFAULT_ROWS = tuple(name for name in ROWS if name not in DEEPSPEED_ROWS)


def default_rows(model: str) -> tuple[str, ...]:
    """The rows a plain run of ``model`` shows. The MLP's stage3 row already partitions every weight (each is
    above the persistence threshold), so its nopersist rows would repeat it."""
    if model == "mlp":
        return tuple(name for name in DEFAULT_ROWS if not name.startswith("stage3_nopersist"))
    return DEFAULT_ROWS


def resolve_rows(requested: list[str]) -> list[Row]:
    """Rows to run, in order: the requested ones, then any peer they need that was not requested."""
    unknown = [name for name in requested if name not in ROWS]
    if unknown:
        raise ValueError(f"--rows: unknown row {unknown[0]!r}; valid rows: {', '.join(ROWS)}")
    names: list[str] = []
    for name in requested:
        for needed in (name, ROWS[name].peer):
            if needed is not None and needed not in names:
                names.append(needed)
    return [ROWS[name] for name in names]


def timing_order(rows: list[Row]) -> list[Row]:
    """The order rows are timed in within a round: each reference row (a peer) in the middle of the rows
    compared with it, so a row and its peer run close together in time and the round's ratio sees nearly the
    same machine (a round of a dozen rows lasts a minute or more, and a loaded machine drifts within it).

    Groups follow the order their reference row first appears (as itself or as a peer); inside a group the
    rows keep their order, the first half before the peer and the rest after it.
    """
    by_name = {row.name: row for row in rows}
    references: list[str] = []
    for row in rows:
        reference = row.name if row.peer is None or row.peer not in by_name else row.peer
        if reference not in references:
            references.append(reference)
    ordered: list[Row] = []
    for reference in references:
        members = [row for row in rows if row.peer == reference and row.name != reference]
        half = (len(members) + 1) // 2
        ordered += [*members[:half], by_name[reference], *members[half:]]
    # A peer that has a peer itself (a chain) would be placed twice: keep its first place.
    unique: list[Row] = []
    for row in [*ordered, *rows]:  # then any row no group took
        if row not in unique:
            unique.append(row)
    return unique
