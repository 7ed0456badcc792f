"""The tensor-parallel benchmark's model, and the one plan both sides slice it by.

A GPT-style decoder written with plain ``nn.Linear`` (token + position embedding, pre-LN blocks of causal
attention and a GELU MLP, final LayerNorm, an LM head tied to the token embedding). The attention projections
are **separate** ``q``, ``k``, ``v`` (not a fused ``qkv``): torch's ``ColwiseParallel`` splits a weight's output
dim into contiguous chunks, so on a fused ``[3·d, d]`` weight rank 0 would get all of q and half of k. Separate
projections let both sides use their stock column-parallel layer (shardspeed's ``ColumnParallelLinear(parts=3)``
would handle a fused one; torch would need a custom layout). Attention reshapes with ``-1`` heads, so the same
forward runs on the dense model and on a slice holding ``n_head / TP`` heads.

``TP_PLAN`` (block-relative module name → column | row) is applied by both sides:
- torch: ``parallelize_module(block, mesh, {name: ColwiseParallel() | RowwiseParallel()})``;
- shardspeed: the ``nn.Linear`` replaced by ``ColumnParallelLinear`` / ``RowParallelLinear`` holding its slice
  (``load_dense``).
Embeddings, LayerNorms and the (tied) LM head stay replicated on both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardspeed.tensor_parallel import TensorParallel

Split = Literal["column", "row"]

# Megatron's pairing: column-parallel into the per-head (or per-hidden-unit) region, row-parallel out of it, so
# each block costs one all-reduce after attention and one after the MLP in forward (and two in backward).
TP_PLAN: dict[str, Split] = {
    "attn.q": "column",
    "attn.k": "column",
    "attn.v": "column",
    "attn.o": "row",
    "mlp.fc": "column",
    "mlp.proj": "row",
}


@dataclass(frozen=True)
class TPModelSize:
    n_layer: int
    d_model: int
    n_head: int
    context_length: int
    micro_batch: int
    vocab_size: int = 256
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "context_length", "micro_batch", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TPModelSize.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_head {self.n_head}")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Both sides split attention by whole heads and the MLP by hidden units: each must divide by TP."""
        if self.n_head % tp_size:
            raise ValueError(f"n_head {self.n_head} is not divisible by the tensor-parallel size {tp_size}")
        if (self.mlp_ratio * self.d_model) % tp_size:
            raise ValueError(f"MLP width {self.mlp_ratio * self.d_model} is not divisible by TP {tp_size}")

    def describe(self) -> str:
        return (
            f"GPT {self.n_layer} layers, d_model {self.d_model}, {self.n_head} heads, context "
            f"{self.context_length}, vocab {self.vocab_size}, micro batch {self.micro_batch}"
        )


# "small" matches benchmarks/bench_rows.py's small GPT (one step ~100 ms per rank on a CPU thread); "tiny" is the
# smoke test's (a step in milliseconds).
TP_MODEL_SIZES: dict[str, TPModelSize] = {
    "tiny": TPModelSize(n_layer=1, d_model=32, n_head=2, context_length=16, micro_batch=2),
    "small": TPModelSize(n_layer=4, d_model=128, n_head=4, context_length=128, micro_batch=8),
    "medium": TPModelSize(n_layer=4, d_model=256, n_head=8, context_length=128, micro_batch=8),
}


class Attention(nn.Module):
    def __init__(self, size: TPModelSize) -> None:
        super().__init__()
        self.head_dim = size.d_model // size.n_head
        self.q = nn.Linear(size.d_model, size.d_model)
        self.k = nn.Linear(size.d_model, size.d_model)
        self.v = nn.Linear(size.d_model, size.d_model)
        self.o = nn.Linear(size.d_model, size.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # -1 heads: all of them on the dense model, this rank's n_head / TP on a sliced one.
        q, k, v = (proj(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    def __init__(self, size: TPModelSize) -> None:
        super().__init__()
        self.fc = nn.Linear(size.d_model, size.mlp_ratio * size.d_model)
        self.proj = nn.Linear(size.mlp_ratio * size.d_model, size.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, size: TPModelSize) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(size.d_model)
        self.attn = Attention(size)
        self.ln_mlp = nn.LayerNorm(size.d_model)
        self.mlp = MLP(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TPBenchGPT(nn.Module):
    """``model(tokens, targets)`` → mean cross-entropy. Dropout-free, so both sides compute the same function."""

    def __init__(self, size: TPModelSize) -> None:
        super().__init__()
        self.size = size
        self.token_embedding = nn.Embedding(size.vocab_size, size.d_model)
        self.position_embedding = nn.Embedding(size.context_length, size.d_model)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.n_layer))
        self.ln_final = nn.LayerNorm(size.d_model)
        self.lm_head = nn.Linear(size.d_model, size.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.normal_(module.bias, mean=0.0, std=0.02)  # non-zero: the sliced biases are exercised too
        for block in self.blocks:
            for residual in (block.attn.o, block.mlp.proj):
                nn.init.normal_(residual.weight, mean=0.0, std=0.02 / math.sqrt(2 * size.n_layer))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_final(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build_dense(size: TPModelSize, seed: int = 0) -> TPBenchGPT:
    """The dense model every side starts from; seeded, so every rank builds identical weights."""
    torch.manual_seed(seed)
    return TPBenchGPT(size)


def make_batches(size: TPModelSize, count: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (tokens, targets) batches, identical on every rank: tensor-parallel ranks must see the same
    data (they hold pieces of one model replica)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (size.micro_batch, size.context_length)
    return [
        (
            torch.randint(0, size.vocab_size, shape, generator=generator),
            torch.randint(0, size.vocab_size, shape, generator=generator),
        )
        for _ in range(count)
    ]


def _submodule_parent(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent_path, _, leaf = dotted.rpartition(".")
    return (root.get_submodule(parent_path) if parent_path else root), leaf


def slice_for_shardspeed(model: TPBenchGPT, tp: TensorParallel) -> TPBenchGPT:
    """Replace each planned ``nn.Linear`` by shardspeed's parallel layer holding this rank's slice (in place)."""
    from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model.size.check_tensor_parallel(tp.size)
    for block in model.blocks:
        for name, split in TP_PLAN.items():
            parent, leaf = _submodule_parent(block, name)
            dense = getattr(parent, leaf)
            if not isinstance(dense, nn.Linear):
                raise TypeError(f"TP_PLAN names {name!r}, which is a {type(dense).__name__}, not an nn.Linear")
            with_bias = dense.bias is not None
            if split == "column":
                sliced: nn.Module = ColumnParallelLinear(dense.in_features, dense.out_features, tp, bias=with_bias)
            else:
                sliced = RowParallelLinear(dense.in_features, dense.out_features, tp, bias=with_bias)
            sliced.load_dense(dense.weight, dense.bias)
            setattr(parent, leaf, sliced.to(dense.weight.device))
    return model


def parallelize_for_torch(model: TPBenchGPT, mesh: DeviceMesh) -> TPBenchGPT:
    """torch's recipe: ``parallelize_module`` on every block with Colwise/Rowwise per ``TP_PLAN`` (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model.size.check_tensor_parallel(mesh.size())
    styles = {"column": ColwiseParallel, "row": RowwiseParallel}
    for block in model.blocks:
        parallelize_module(block, mesh, {name: styles[split]() for name, split in TP_PLAN.items()})
    return model
