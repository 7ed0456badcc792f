"""Shared pieces of the parity tests: a deterministic model, global batches, and the plain-torch reference.

The engine on rank r, micro-step m sees rows [(m·N + r)·mb, (m·N + r + 1)·mb) of the global batch — the layout of
shardspeed's global-index sampler — and the reference trains plain torch on the whole global batch at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardspeed

IN, HIDDEN, OUT = 7, 13, 3  # awkward sizes on purpose


class TinyNet(torch.nn.Module):
    def __init__(self, tied: bool = False, frozen: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.mid2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.unused = torch.nn.Linear(3, 3) if unused else None
        if tied:
            self.mid2.weight = self.mid.weight  # shared parameter reached through two modules
        if frozen:
            self.inp.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid2(h))
        return self.out(h)


def make_model(seed: int = 0, **kwargs: Any) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kwargs)


def global_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and learnable targets (a fixed random teacher plus noise), so training makes real progress."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234))
    out = []
    for _ in range(steps):
        x = torch.randn(batch, IN, generator=g)
        out.append((x, torch.tanh(x @ teacher) + 0.05 * torch.randn(batch, OUT, generator=g)))
    return out


def rank_slice(x: torch.Tensor, micro: int, rank: int, world: int, mb: int) -> torch.Tensor:
    start = (micro * world + rank) * mb
    return x[start : start + mb]


def optimizer_config(kind: str, lr: float) -> dict:
    if kind == "adamw":
        return {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}
    if kind == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}
    if kind == "lamb":
        return {"type": "Lamb", "params": {"lr": lr, "weight_decay": 0.01}}
    if kind == "lion":
        return {"type": "Lion", "params": {"lr": lr / 10, "weight_decay": 0.01}}
    raise ValueError(kind)


def torch_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """The unsharded reference optimizer (Lamb and Lion: shardspeed's own, unit-tested against their papers)."""
    from shardspeed.optim.lamb import Lamb
    from shardspeed.optim.lion import Lion

    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if kind == "lamb":
        return Lamb(params, lr=lr, weight_decay=0.01)
    if kind == "lion":
        return Lion(params, lr=lr / 10, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def two_groups(model: torch.nn.Module, lr: float) -> list[dict]:
    """Weights with weight decay, biases with half the lr and none: hyperparameters per group must survive."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and p.requires_grad]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": lr / 2, "weight_decay": 0.0}]


def reference_run(
    kind: str, lr: float, clip: float, batches: list, model_kwargs: dict | None = None, groups: bool = False
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch on the full global batch; returns final parameters and the pre-clip grad norms."""
    model = make_model(**(model_kwargs or {}))
    params = two_groups(model, lr) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch_optimizer(kind, params, lr)
    norms = []
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():  # engines give unused trainable parameters a zero gradient (DeepSpeed/DDP)
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def train_engine(engine: Any, rank: int, world: int, batches: list, mb: int, gas: int) -> list[float]:
    """Run whole global batches through an engine (inputs cast to its dtype); the per-micro-step losses."""
    dtype = next(iter(engine.module.parameters())).dtype
    losses = []
    for x, y in batches:
        for m in range(gas):
            out = engine(rank_slice(x, m, rank, world, mb).to(dtype)).float()
            loss = F.mse_loss(out, rank_slice(y, m, rank, world, mb))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's whole parameters by name, fp32 (gathered under ZeRO-3)."""
    full = engine.module_state_dict()
    return {n: full[n].float().clone() for n, _ in engine.module.named_parameters()}


OFFLOAD_AIO = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}  # small blocks: tiny tensors still stream


def offload_engine(
    zero: dict[str, Any],
    *,
    bf16: bool = False,
    clip: float = 0.5,
    optimizer: str = "AdamW",
    model: TinyNet | None = None,
    params: Any = None,
    mb: int = 2,
    gas: int = 2,
) -> Any:
    """The offload tests' engine: ``TinyNet`` (or ``model``), AdamW-style lr 0.05 / weight decay 0.01, clipping,
    ``OFFLOAD_AIO``, and zero settings that exercise the streaming (``sub_group_size`` 37: several chunks per
    stepped tensor; no persistent ZeRO-3 units) unless ``zero`` says otherwise. ``params``: what goes to the
    optimizer (default: the trainable parameters)."""
    model = model if model is not None else make_model()
    config = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": optimizer, "params": {"lr": 0.05, "weight_decay": 0.01}},
        "gradient_clipping": clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage3_param_persistence_threshold": 0, "sub_group_size": 37, **zero},
        "aio": OFFLOAD_AIO,
        "steps_per_print": 1000,
    }
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = shardspeed.initialize(model=model, model_parameters=params, config=config)
    return engine
