"""The benchmark's models and fixed batches: the demo GPT (``small``, ``medium``) and the issue's comm-bound MLP.

Every row copies one seeded template (identical weights on every rank and in every row) and trains on this
rank's fixed batch (different per rank, as in real data parallelism; the same for every row on a given rank).

``mlp`` is the communication-bound model of issue #16: 6 × Linear(1024, 1024) (6.3M parameters), GELU between
them, batch 32, MSE loss against a fixed random target. Its compute per parameter is tiny (32 rows), so a step
is mostly gradient reduction and parameter gathering: the model that shows what the communication layer costs.
The GPT is the opposite end: a real model whose step is mostly compute.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    """A demo GPT's shape and micro batch (tokens: micro_batch × context_length)."""

    n_layer: int
    d_model: int
    n_head: int
    context_length: int
    micro_batch: int


@dataclass(frozen=True)
class MLPSize:
    """The comm-bound MLP: ``n_layer`` square Linear layers of ``width``, on ``micro_batch`` rows."""

    n_layer: int
    width: int
    micro_batch: int


# GPT sizes chosen so one step takes roughly 50-200 ms (small) and 150-400 ms (medium) on one CPU thread per rank.
MODEL_SIZES: dict[str, ModelSize | MLPSize] = {
    "small": ModelSize(n_layer=4, d_model=128, n_head=4, context_length=128, micro_batch=8),
    "medium": ModelSize(n_layer=4, d_model=192, n_head=4, context_length=128, micro_batch=8),
    "mlp": MLPSize(n_layer=6, width=1024, micro_batch=32),
}


class CommBoundMLP(nn.Module):
    """``blocks``: Linear + GELU each (the last Linear alone); ``forward(x, target)`` returns the MSE loss.

    Each Linear sits in its own block so FSDP2 can ``fully_shard`` it (the recipe shards per block).
    """

    def __init__(self, size: MLPSize) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(size.width, size.width), nn.GELU()) for _ in range(size.n_layer - 1)]
        blocks.append(nn.Sequential(nn.Linear(size.width, size.width)))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = inputs
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, targets)


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


def build_template_model(size: ModelSize | MLPSize) -> tuple[nn.Module, str]:
    """The model every row copies, plus a description. Seeded, so every rank builds identical weights."""
    torch.manual_seed(0)
    if isinstance(size, MLPSize):
        shape = f"{size.n_layer} x Linear({size.width}, {size.width}), GELU, MSE, batch {size.micro_batch}"
        return CommBoundMLP(size), f"comm-bound MLP ({shape})"
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
    """What every row shares: the template model (never trained itself), this rank's fixed batch, the device."""

    template: nn.Module
    model_description: str
    inputs: torch.Tensor
    targets: torch.Tensor
    micro_batch: int
    device: torch.device

    def fresh_model(self) -> nn.Module:
        # A deep copy keeps tied weights tied and leaves the template untouched for the next row.
        return copy.deepcopy(self.template).to(self.device)


def make_batch(size: ModelSize | MLPSize, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed (inputs, targets), from a generator seeded by the rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    if isinstance(size, MLPSize):
        shape = (size.micro_batch, size.width)
        return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    shape = (size.micro_batch, size.context_length)
    return torch.randint(0, 256, shape, generator=generator), torch.randint(0, 256, shape, generator=generator)


def make_setup(size: ModelSize | MLPSize, rank: int, device: torch.device | str = "cpu") -> BenchSetup:
    template, description = build_template_model(size)
    inputs, targets = make_batch(size, rank)
    device = torch.device(device)
    return BenchSetup(template, description, inputs.to(device), targets.to(device), size.micro_batch, device)
