"""A GPT-style test model built from the tensor-parallel layers, and its dense twin (the same class at TP=1).

``TPGPT(config, tp)``: vocab-parallel token embedding + learned positions, pre-LN blocks (fused-QKV
column-parallel attention, row-parallel projection; column/row MLP), a final LayerNorm, and an LM head tied to the
token embedding whose vocab-split logits go straight into the vocab-parallel cross-entropy (no gather).
``forward(tokens, targets) -> loss``.

Every layer draws its *global* init and slices it, in a fixed order, so after the same seed a model at TP=2 starts
equal to the dense one; ``global_state_dict()`` / ``load_global_state_dict(sd)`` convert to and from the dense
state dict through the parameter specs. ``solo_tp()`` is the tensor axis of one rank that the dense twin uses.

Under ``sequence_parallel`` (a ``TensorParallel(sequence_parallel=True)``) the residual stream is split along the
sequence: the embedding reduce-scatters, positions are sliced to this rank's shard, layer norms run on shards
(their gradients are partial: declared ``partial_grad`` and summed by ``sum_partial_grads`` / the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardspeed.checkpointing.rng import RNGStatesTracker
from shardspeed.params.assemble import assemble_global
from shardspeed.params.spec import ParamSpec, ParamSpecs
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardspeed.tensor_parallel.embedding import VocabParallelEmbedding, VocabParallelLMHead
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.tensor_parallel.random import TensorParallelDropout
from shardspeed.topology import AxisGroup


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 37  # awkward on purpose: not divisible by 2 or 4
    max_seq: int = 8
    hidden: int = 16
    heads: int = 4
    layers: int = 2
    ffn: int = 40  # 40/4 = 10 per rank at TP=4; not a power of two
    dropout: float = 0.0
    qkv_bias: bool = False
    """Off by default: the key bias's true gradient is exactly zero (softmax ignores a per-row shift of the scores),
    so what it gets is fp32 rounding noise that differs with the summation order, and Adam turns that noise into
    ±lr steps — no two implementations agree on it to 1e-5."""


def solo_tp() -> TensorParallel:
    """A tensor axis of one rank (this process alone): the dense twin's."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return TensorParallel(AxisGroup("tensor", None, (rank,), 0))


class _ShardNorm(nn.LayerNorm):
    """A LayerNorm on the residual stream; under sequence parallelism it sees a sequence shard, so its gradient is
    partial over the tensor axis (declared, never an attribute on the parameter)."""

    def __init__(self, hidden: int, tp: TensorParallel) -> None:
        super().__init__(hidden)
        self.partial = tp.sequence_parallel and tp.size > 1

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        # Shapes from the config, not from the parameters: under ZeRO-3 they are empty placeholders between uses.
        spec = ParamSpec(tuple(self.normalized_shape), partial_grad=self.partial)
        return {"weight": spec, "bias": spec}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TensorParallel, tracker: RNGStatesTracker | None) -> None:
        super().__init__()
        if cfg.heads % tp.size:
            raise ValueError(f"TPGPT: {cfg.heads} heads cannot be split over {tp.size} tensor ranks")
        self.tp = tp
        self.local_heads = cfg.heads // tp.size
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, tp, bias=cfg.qkv_bias, parts=3)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, tp)
        self.attn_drop = TensorParallelDropout(cfg.dropout, tracker, "split")  # this rank's heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3·h/TP]: this rank's heads of q, of k, of v
        b, s, _ = qkv.shape
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.attn_drop(scores.masked_fill(causal, float("-inf")).softmax(-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(cfg.hidden, cfg.ffn, tp)
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TensorParallel, tracker: RNGStatesTracker | None) -> None:
        super().__init__()
        region = "split" if tp.sequence_parallel else "replicated"  # the residual stream's kind
        self.ln1 = _ShardNorm(cfg.hidden, tp)
        self.attn = Attention(cfg, tp, tracker)
        self.ln2 = _ShardNorm(cfg.hidden, tp)
        self.mlp = MLP(cfg, tp)
        self.drop = TensorParallelDropout(cfg.dropout, tracker, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TPGPT(nn.Module):
    """GPT with tied embeddings on a tensor axis ``tp`` (``solo_tp()``: the dense twin)."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallel, tracker: RNGStatesTracker | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, tp)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.pos_partial = tp.sequence_parallel and tp.size > 1
        self.drop = TensorParallelDropout(cfg.dropout, tracker, "split" if tp.sequence_parallel else "replicated")
        self.blocks = nn.ModuleList(Block(cfg, tp, tracker) for _ in range(cfg.layers))
        self.ln_f = _ShardNorm(cfg.hidden, tp)
        self.head = VocabParallelLMHead(self.wte)  # tied: the same parameter as wte.weight

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return {"wpe.weight": ParamSpec((self.cfg.max_seq, self.cfg.hidden), partial_grad=self.pos_partial)}

    def _positions(self, s: int, device: torch.device) -> torch.Tensor:
        ids = torch.arange(s, device=device)
        if self.tp.sequence_parallel and self.tp.size > 1:  # the embedding output is this rank's sequence chunk
            if s % self.tp.size:
                raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size {self.tp.size}")
            ids = ids.chunk(self.tp.size)[self.tp.rank]
        return self.wpe(ids)  # through the module (ZeRO-3 gathers wpe in its forward hooks)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self._positions(tokens.shape[1], tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.hidden_states(tokens))  # [b, s, ceil(V/TP)]: vocab-split, not gathered
        return vocab_parallel_cross_entropy(logits, targets, self.tp, vocab_size=self.cfg.vocab_size)

    # --- dense ↔ sliced ----------------------------------------------------------------------------------------
    def specs(self) -> ParamSpecs:
        return ParamSpecs.collect(self, self.tp.rank, self.tp.size)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict (every tensor rank gets it; collective over the tensor axis)."""
        return gather_global(self, {n: p.detach() for n, p in self.named_parameters()})

    def global_grads(self) -> dict[str, torch.Tensor]:
        """The dense model's gradients, assembled from the ranks' slices (partial gradients summed first)."""
        grads = {n: p.grad.detach() for n, p in self.named_parameters() if p.grad is not None}
        return gather_global(self, sum_partial_grads(self, grads))

    def load_global_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice of every dense tensor in ``sd`` (the keys of ``named_parameters()``)."""
        specs = self.specs()
        own = dict(self.named_parameters())
        if set(sd) != set(own):
            raise KeyError(
                f"load_global_state_dict: missing {sorted(set(own) - set(sd))}, unexpected {sorted(set(sd) - set(own))}"
            )
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(specs.of(p, name).slice_global(sd[name], self.tp.rank, self.tp.size))


def sum_partial_grads(model: TPGPT, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replicated parameters with partial gradients (``partial_grad``) summed over the tensor axis."""
    specs, out = model.specs(), dict(grads)
    params = dict(model.named_parameters())
    for name, g in grads.items():
        if specs.of(params[name], name).partial_grad:
            g = g.clone()
            model.tp.collectives.all_reduce(g, model.tp.axis, tag="test.partial_grad")
            out[name] = g
    return out


def gather_global(model: TPGPT, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense tensors from every tensor rank's local pieces, placed by the specs' boxes (padding left out)."""
    tp, specs = model.tp, model.specs()
    pieces = (
        tp.collectives.all_gather_object({n: t.cpu() for n, t in local.items()}, tp.axis)
        if tp.size > 1
        else [{n: t.cpu() for n, t in local.items()}]
    )
    # Undeclared parameters are replicated with the local tensor's shape (not the parameter's: under ZeRO-3 the
    # parameter is an empty placeholder between uses).
    return {
        name: assemble_global(specs.by_name(name) or ParamSpec(tuple(t.shape)), [p[name] for p in pieces])
        for name, t in local.items()
    }
