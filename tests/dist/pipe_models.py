"""A tiny GPT written as DeepSpeed pipeline layers, its single-process twin, and the batches both train on (S7).

``gpt_layers(vocab, dim, n_blocks, seq)`` is the list a user hands to ``PipelineModule`` (DeepSpeed's API):

    0                 TiedLayerSpec("embed", TokenEmbedding, vocab, dim)            tokens [b, s] → x [b, s, dim]
    1                 LayerSpec(Positions, seq, dim)                              x + learned positions
    2 … n_blocks+1    LayerSpec(Block, dim, heads, ffn, tp)                       pre-LN attention + MLP
    n_blocks+2        LayerSpec(nn.LayerNorm, dim)                                final norm
    n_blocks+3        TiedLayerSpec("embed", TokenEmbedding, …, forward_fn=tied_head)    logits x @ embedᵀ [b, s, vocab]

With ``tied=True`` (the default) the first and last layers share the embedding weight: under PP=2 the first stage
owns it, the last stage holds a copy, and their gradients are summed by ``ReduceTiedGrads``. ``tied=False`` makes
the head a plain ``LayerSpec(Head, dim, vocab)``. ``tp`` (a ``TensorParallel`` on the topology's tensor axis) builds
the blocks from ``ColumnParallelLinear`` / ``RowParallelLinear`` (fused QKV split by heads, MLP up column, the
projections row); embeddings, positions and norms stay replicated over the tensor axis.

Why the weights do not depend on the stage count or the tensor degree: ``PipelineModule(seed_layers=True)`` seeds
each layer's build with ``base_seed + global index``; ``reference_model`` builds the same layers in one process with
the same seeds; the tensor-parallel linears draw their *global* weight (nn.Linear's init, in nn.Linear's order) and
keep their slice, so a dense block (``tp=None``) built after the same seed holds exactly the slices' union.
A tied module is built by the first layer that uses it (seed ``base_seed`` + that index); a later stage's copy is
overwritten from the owner by ``sync_tied_weights``.

``make_batches`` draws learnable token data (labels are a fixed function of the token and its predecessor); the
engine's rank reads the micro-batches of ``rank_micro_batches`` (the global-index sampler's layout: micro-batch
``j`` of data rank ``r`` = rows ``[(j·dp + r)·mb, (j·dp + r + 1)·mb)``), the reference the whole global batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from shardspeed.tensor_parallel import TensorParallel

BASE_SEED = 1234  # PipelineModule's default base_seed


@dataclass(frozen=True)
class PipeGPTConfig:
    vocab: int = 64
    dim: int = 32
    n_blocks: int = 4
    seq: int = 8
    heads: int = 4
    ffn: int = 64


# --- layers ------------------------------------------------------------------------------------------------------
class TokenEmbedding(nn.Embedding):
    """nn.Embedding with GPT-2's init (std 0.02): with N(0, 1) the tied head's logits start at std √dim and the
    first loss is ~7× ln(vocab)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Positions(nn.Module):
    """Adds learned positions to the token embeddings (a layer of its own, so the tied module is only the
    embedding: the last stage's copy then holds nothing but the tied weight)."""

    def __init__(self, seq: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


def _linear(
    kind: str, in_features: int, out_features: int, tp: TensorParallel | None, *, bias: bool = True, parts: int = 1
) -> nn.Module:
    """nn.Linear when dense; the tensor-parallel twin otherwise (same global init, same RNG draws)."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if kind == "column":
        return ColumnParallelLinear(in_features, out_features, tp, bias=bias, parts=parts)
    return RowParallelLinear(in_features, out_features, tp, bias=bias)


class Block(nn.Module):
    """Pre-LN causal self-attention + GELU MLP. ``tp``: heads and the MLP's hidden units split over the tensor
    axis (Megatron's column → row pairs); None: dense."""

    def __init__(self, dim: int, heads: int, ffn: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        size = 1 if tp is None else tp.size
        if heads % size:
            raise ValueError(f"Block: {heads} heads cannot be split over {size} tensor ranks")
        self.local_heads = heads // size
        self.head_dim = dim // heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = _linear("column", dim, 3 * dim, tp, bias=False, parts=3)
        self.proj = _linear("row", dim, dim, tp)
        self.ln2 = nn.LayerNorm(dim)
        self.up = _linear("column", dim, ffn, tp)
        self.down = _linear("row", ffn, dim, tp)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3·dim/T]: this rank's heads of q, of k, of v
        b, s, _ = qkv.shape
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Head(nn.Module):
    """The untied LM head (``tied=False``)."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def tied_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied LM head: the hidden states against the embedding matrix (DeepSpeed's ``forward_fn``)."""
    return x @ embedding.weight.t()


class BiasedEmbedding(TokenEmbedding):
    """The tied embedding with a second parameter only the head reads (``head_bias=True``): a tied module whose
    parameters are not all in ``tied_weight_attr`` ([Note: the whole tied module is shared] in pipe/module.py)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, dim)
        self.head_bias = nn.Parameter(torch.randn(vocab) * 0.02)


def biased_tied_head(embedding: BiasedEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The tied LM head plus the module's own bias (trained by the last stage only)."""
    return x @ embedding.weight.t() + embedding.head_bias


@dataclass(frozen=True)
class LayerPlan:
    """One layer, framework-free: ``tie`` is the tie key (None: a plain layer); ``forward_fn`` a tied module's
    later use. ``gpt_layers`` turns these into shardspeed's specs, the DeepSpeed worker into DeepSpeed's, the torch
    bench builds them directly (the three sides of ``benchmarks/bench_pipe.py`` train the same layers)."""

    cls: type
    args: tuple
    tie: str | None = None
    forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def build(self) -> nn.Module:
        return self.cls(*self.args)


def layer_plan(
    vocab: int = 64,
    dim: int = 32,
    n_blocks: int = 4,
    seq: int = 8,
    *,
    tied: bool = True,
    tp: TensorParallel | None = None,
    heads: int = 4,
    ffn: int = 64,
    head_bias: bool = False,
) -> list[LayerPlan]:
    """The GPT's layers in order (module docstring; ``head_bias``: the tied module is a ``BiasedEmbedding``)."""
    emb, head = (BiasedEmbedding, biased_tied_head) if head_bias else (TokenEmbedding, tied_head)
    first = LayerPlan(emb, (vocab, dim), tie="embed" if tied else None)
    last = LayerPlan(emb, (vocab, dim), "embed", head) if tied else LayerPlan(Head, (dim, vocab))
    blocks = [LayerPlan(Block, (dim, heads, ffn, tp)) for _ in range(n_blocks)]
    return [first, LayerPlan(Positions, (seq, dim)), *blocks, LayerPlan(nn.LayerNorm, (dim,)), last]


def gpt_layers(
    vocab: int = 64,
    dim: int = 32,
    n_blocks: int = 4,
    seq: int = 8,
    *,
    tied: bool = True,
    tp: TensorParallel | None = None,
    heads: int = 4,
    ffn: int = 64,
    head_bias: bool = False,
) -> list[Any]:
    """The GPT's layers as shardspeed's ``LayerSpec`` / ``TiedLayerSpec`` (DeepSpeed's API; module docstring)."""
    from shardspeed.pipe import LayerSpec, TiedLayerSpec

    plan = layer_plan(vocab, dim, n_blocks, seq, tied=tied, tp=tp, heads=heads, ffn=ffn, head_bias=head_bias)
    return [
        TiedLayerSpec(p.tie, p.cls, *p.args, forward_fn=p.forward_fn) if p.tie else LayerSpec(p.cls, *p.args)
        for p in plan
    ]


def gpt_layers_from(cfg: PipeGPTConfig, *, tied: bool = True, tp: TensorParallel | None = None) -> list[Any]:
    return gpt_layers(cfg.vocab, cfg.dim, cfg.n_blocks, cfg.seq, tied=tied, tp=tp, heads=cfg.heads, ffn=cfg.ffn)


def gpt_loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (``PipelineModule(loss_fn=...)``: called on the last stage's output and labels)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _tie_of(layer: Any) -> tuple[str | None, Any]:
    """(tie key, forward_fn) of a LayerPlan or a TiedLayerSpec; (None, None) for anything else."""
    if isinstance(layer, LayerPlan):
        return layer.tie, layer.forward_fn
    key = getattr(layer, "key", None)  # TiedLayerSpec (DeepSpeed's attribute names)
    return (key, getattr(layer, "forward_fn", None)) if isinstance(key, str) else (None, None)


# --- the single-process reference --------------------------------------------------------------------------------
class ReferenceGPT(nn.Module):
    """The same layers in one process, named as ``PipelineModule`` names them (``"{idx}.…"``, tied modules under
    ``"tied_modules.{key}."``), so the pipeline's parameters compare with these by name on any stage count."""

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        base_seed: int = BASE_SEED,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = gpt_loss_fn,
    ) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.tied_modules = nn.ModuleDict()
        self._calls: list[Callable[[Any], Any]] = []
        for idx, layer in enumerate(layers):
            tie, forward_fn = _tie_of(layer)
            if tie is not None:
                if tie not in self.tied_modules:
                    torch.manual_seed(base_seed + idx)
                    self.tied_modules[tie] = layer.build()
                module = self.tied_modules[tie]
                self._calls.append(module if forward_fn is None else functools.partial(forward_fn, module))
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self._calls.append(layer)
            elif hasattr(layer, "build"):  # a LayerSpec or a LayerPlan
                torch.manual_seed(base_seed + idx)
                module = layer.build()
                self.add_module(str(idx), module)
                self._calls.append(module)
            else:  # a plain callable layer (e.g. a lambda), as DeepSpeed accepts
                self._calls.append(layer)

    def forward(self, inputs: Any) -> Any:
        x = inputs
        for call in self._calls:
            x = call(x)
        return x

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self.loss_fn is not None
        return self.loss_fn(self(tokens), labels)


def reference_model(
    vocab: int = 64,
    dim: int = 32,
    n_blocks: int = 4,
    seq: int = 8,
    *,
    tied: bool = True,
    heads: int = 4,
    ffn: int = 64,
    base_seed: int = BASE_SEED,
    head_bias: bool = False,
) -> ReferenceGPT:
    """The dense GPT of ``gpt_layers(...)`` in one process (the parity reference for every mesh, TP included)."""
    plan = layer_plan(vocab, dim, n_blocks, seq, tied=tied, tp=None, heads=heads, ffn=ffn, head_bias=head_bias)
    return ReferenceGPT(plan, base_seed=base_seed)


# --- data --------------------------------------------------------------------------------------------------------
def make_batches(
    steps: int,
    micro_batches: int,
    micro_batch_size: int,
    data_parallel: int = 1,
    *,
    vocab: int = 64,
    seq: int = 8,
    seed: int = 7,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch per step: ``(tokens, labels)`` of ``micro_batches·data_parallel·micro_batch_size`` rows.
    Labels are ``(3·token + previous token + 1) mod vocab``: a rule the model can learn (the loss falls)."""
    g = torch.Generator().manual_seed(seed)
    rows = micro_batches * data_parallel * micro_batch_size
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (rows, seq), generator=g)
        previous = torch.roll(tokens, 1, dims=1)
        previous[:, 0] = 0
        out.append((tokens, (3 * tokens + previous + 1) % vocab))
    return out


def rank_micro_batches(
    batch: tuple[torch.Tensor, torch.Tensor], micro_batches: int, data_rank: int, data_parallel: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data rank ``data_rank``'s micro-batches of a global batch (the global-index sampler's layout)."""
    tokens, labels = batch
    mb = tokens.shape[0] // (micro_batches * data_parallel)
    out = []
    for j in range(micro_batches):
        start = (j * data_parallel + data_rank) * mb
        out.append((tokens[start : start + mb], labels[start : start + mb]))
    return out


def rank_iterator(
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]], micro_batches: int, data_rank: int, data_parallel: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches a pipeline rank reads over all steps, in order (``train_batch(data_iter=...)``)."""
    for batch in batches:
        yield from rank_micro_batches(batch, micro_batches, data_rank, data_parallel)


def reference_train(
    model: ReferenceGPT,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    micro_batches: int,
    clip: float = 0.0,
    norms: list[float] | None = None,
) -> list[float]:
    """Plain torch on the global batches: per step the mean of the micro-batch mean losses (what the pipeline
    engine's ``train_batch`` averages over micro-batches and data ranks); returns the step losses. ``norms``: when
    given, receives each step's gradient norm before clipping (with ``clip`` > 0)."""
    losses = []
    for tokens, labels in batches:
        optimizer.zero_grad()
        total = 0.0
        for t, lab in zip(tokens.chunk(micro_batches), labels.chunk(micro_batches), strict=True):
            loss = model.loss(t, lab) / micro_batches
            loss.backward()
            total += float(loss.detach())
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
        losses.append(total)
    return losses
