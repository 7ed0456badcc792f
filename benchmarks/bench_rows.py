"""The benchmark's rows: each is one way to train the same model, compared with a peer row.

A row is (name, build, peer). ``build(setup)`` wraps a fresh copy of the template model and returns a
``step()`` callable that runs one full optimizer step on the fixed batch and returns the loss. Every row
trains from identical weights on identical data with the same AdamW hyperparameters, so the rows differ only
in the training system, and their losses after the same number of steps should agree (a printed sanity
check).

Adding a row is one builder function and one entry in ``_ROW_LIST`` (rows not from DeepSpeed are shown by
default); e.g. the stage-1 pair:

    def _build_zero_redundancy(setup: BenchSetup) -> StepFn:
        model = DDP(setup.fresh_model())
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW_PARAMS)
        return _torch_step(model, optimizer, setup)

    _shardspeed_row("stage1", "shardspeed ZeRO stage 1", 1, "zero_redundancy"),
    Row("zero_redundancy", "torch DDP + ZeroRedundancyOptimizer(AdamW)", _build_zero_redundancy, None),

The peers: stage 0 ↔ torch DDP, stage 1 ↔ torch ZeroRedundancyOptimizer (torch's own optimizer-state
sharding over DDP), stage 2 ↔ shardspeed stage 0 (gradient sharding should cost little over plain data
parallelism), stage 3 ↔ torch FSDP2 (``fully_shard`` per transformer block, then the root).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

StepFn = Callable[[], torch.Tensor]

# Spelled out in full so the torch rows and the config-built rows cannot drift apart through different
# defaults (shardspeed, like DeepSpeed, defaults AdamW's weight_decay differently from torch).
ADAMW_PARAMS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclass(frozen=True)
class ModelSize:
    n_layer: int
    d_model: int
    n_head: int
    context_length: int
    micro_batch: int


# Chosen so one step takes roughly 50-200 ms (small) and 150-400 ms (medium) on one CPU thread per rank.
MODEL_SIZES: dict[str, ModelSize] = {
    "small": ModelSize(n_layer=4, d_model=128, n_head=4, context_length=128, micro_batch=8),
    "medium": ModelSize(n_layer=4, d_model=192, n_head=4, context_length=128, micro_batch=8),
}


class _FallbackMLP(nn.Module):
    """Token embedding → GELU MLP stack → vocabulary head; used only if the demo GPT cannot be imported."""

    def __init__(self, size: ModelSize, vocab_size: int = 256) -> None:
        super().__init__()
        width = size.d_model
        self.embedding = nn.Embedding(vocab_size, width)
        self.layers = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(size.n_layer)
            )
        )
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.layers(self.embedding(tokens)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build_template_model(size: ModelSize) -> tuple[nn.Module, str]:
    """The model every row copies, plus a description. Seeded, so every rank builds identical weights."""
    torch.manual_seed(0)
    try:
        from shardspeed.demo.model import GPT, GPTConfig
    except ImportError as error:
        model = _FallbackMLP(size)
        return (
            model,
            f"fallback MLP ({size.n_layer} layers, width {size.d_model}; demo GPT not importable: {error})",
        )
    config = GPTConfig(
        context_length=size.context_length, n_layer=size.n_layer, d_model=size.d_model, n_head=size.n_head
    )
    shape = f"{size.n_layer} layers, d_model {size.d_model}, {size.n_head} heads, context {size.context_length}"
    return GPT(config), f"demo GPT ({shape})"


@dataclass(frozen=True)
class BenchSetup:
    """What every row shares: the template model (never trained itself) and this rank's fixed batch."""

    template: nn.Module
    model_description: str
    inputs: torch.Tensor
    targets: torch.Tensor
    micro_batch: int

    def fresh_model(self) -> nn.Module:
        # A deep copy keeps tied weights tied and leaves the template untouched for the next row.
        return copy.deepcopy(self.template)


def make_setup(size: ModelSize, rank: int) -> BenchSetup:
    template, description = build_template_model(size)
    # Different data per rank, as in real data parallelism; the same data for every row on a given rank.
    generator = torch.Generator().manual_seed(1000 + rank)
    shape = (size.micro_batch, size.context_length)
    inputs = torch.randint(0, 256, shape, generator=generator)
    targets = torch.randint(0, 256, shape, generator=generator)
    return BenchSetup(template, description, inputs, targets, size.micro_batch)


def engine_config(setup: BenchSetup, stage: int, zero_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed-format config shared by shardspeed and DeepSpeed rows; ``zero_extra`` adds
    ``zero_optimization`` keys (e.g. a stage-3 persistence threshold)."""
    return {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW_PARAMS, "betas": list(ADAMW_PARAMS["betas"])}},
        "zero_optimization": {"stage": stage, **(zero_extra or {})},
        "steps_per_print": 10**9,
    }


def _engine_step(engine: Any, setup: BenchSetup) -> StepFn:
    """The DeepSpeed-style loop, shared by shardspeed and DeepSpeed engines."""

    def step() -> torch.Tensor:
        loss = engine(setup.inputs, setup.targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _torch_step(model: nn.Module, optimizer: torch.optim.Optimizer, setup: BenchSetup) -> StepFn:
    """The plain torch loop; set_to_none is torch's default for zero_grad."""

    def step() -> torch.Tensor:
        loss = model(setup.inputs, setup.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _build_shardspeed(setup: BenchSetup, stage: int, zero_extra: dict[str, Any] | None = None) -> StepFn:
    import shardspeed

    model = setup.fresh_model()
    engine, _, _, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(setup, stage, zero_extra)
    )
    return _engine_step(engine, setup)


def _build_ddp(setup: BenchSetup) -> StepFn:
    model = DDP(setup.fresh_model())  # default settings: what a torch user gets without tuning
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_PARAMS)
    return _torch_step(model, optimizer, setup)


def _build_zero_redundancy(setup: BenchSetup) -> StepFn:
    """torch's own stage-1 equivalent: DDP all-reduces gradients, each rank steps AdamW on its share of the
    parameters and broadcasts the result."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DDP(setup.fresh_model())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW_PARAMS)
    return _torch_step(model, optimizer, setup)


def _fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: the demo GPT's transformer blocks (the fallback MLP's layers)."""
    for attribute in ("blocks", "layers"):
        children = getattr(model, attribute, None)
        if isinstance(children, (nn.ModuleList, nn.Sequential)):
            return list(children)
    raise TypeError(f"{type(model).__name__} has neither .blocks nor .layers; the fsdp2 row cannot wrap it")


def _build_fsdp2(setup: BenchSetup) -> StepFn:
    """torch FSDP2, the usual recipe: ``fully_shard`` each transformer block, then the root (which takes the
    embeddings, the tied head and the final norm), on a 1-D CPU mesh over the gloo group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = setup.fresh_model()
    for block in _fsdp_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_PARAMS)
    return _torch_step(model, optimizer, setup)


def _build_deepspeed(setup: BenchSetup, stage: int) -> StepFn:
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
    build: Callable[[BenchSetup], StepFn]
    peer: str | None  # the row this one's step time is divided by; None for a reference row
    optional: bool = False  # an optional row that fails to build is reported and skipped, not fatal
    # Imports the row's library. Memory runs call every row's preload before measuring, so each row's
    # process holds the same modules and import costs neither differ between rows nor count as a row's growth.
    preload: Callable[[], None] = _import_nothing


def _shardspeed_row(name: str, description: str, stage: int, peer: str, **zero_extra: Any) -> Row:
    build = partial(_build_shardspeed, stage=stage, zero_extra=zero_extra or None)
    return Row(name, description, build, peer, preload=_import_shardspeed)


def _deepspeed_row(name: str, description: str, stage: int, peer: str) -> Row:
    build = partial(_build_deepspeed, stage=stage)
    return Row(name, description, build, peer, optional=True, preload=_import_deepspeed)


_ROW_LIST = [
    _shardspeed_row("stage0", "shardspeed ZeRO stage 0", 0, "ddp"),
    Row("ddp", "torch DistributedDataParallel", _build_ddp, None),
    _shardspeed_row("stage1", "shardspeed ZeRO stage 1", 1, "zero_redundancy"),
    Row("zero_redundancy", "torch DDP + ZeroRedundancyOptimizer(AdamW)", _build_zero_redundancy, None),
    _shardspeed_row("stage2", "shardspeed ZeRO stage 2", 2, "stage0"),
    _shardspeed_row("stage3", "shardspeed ZeRO stage 3 (default thresholds)", 3, "fsdp2"),
    # With the default persistence threshold (1e5 elements) every tensor of the small model stays whole on
    # every rank, so the default stage-3 row gathers nothing; this row partitions every parameter, like FSDP2.
    _shardspeed_row(
        "stage3_nopersist",
        "shardspeed ZeRO stage 3, stage3_param_persistence_threshold 0",
        3,
        "fsdp2",
        stage3_param_persistence_threshold=0,
    ),
    Row("fsdp2", "torch FSDP2 (fully_shard per block, then root)", _build_fsdp2, None),
    _deepspeed_row("deepspeed0", "DeepSpeed ZeRO stage 0", 0, "ddp"),
    _deepspeed_row("deepspeed1", "DeepSpeed ZeRO stage 1", 1, "zero_redundancy"),
    _deepspeed_row("deepspeed2", "DeepSpeed ZeRO stage 2", 2, "stage0"),
    _deepspeed_row("deepspeed3", "DeepSpeed ZeRO stage 3", 3, "fsdp2"),
]
ROWS: dict[str, Row] = {row.name: row for row in _ROW_LIST}

DEEPSPEED_ROWS = ("deepspeed0", "deepspeed1", "deepspeed2", "deepspeed3")

# What a plain run shows (DeepSpeed's rows are added when deepspeed is installed): every row but the DeepSpeed ones.
DEFAULT_ROWS = tuple(name for name in ROWS if name not in DEEPSPEED_ROWS)


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
