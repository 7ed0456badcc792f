"""A tiny tensor-parallel transformer for the layer, sequence-parallel and traffic tests.

Pre-LN block: ``x + attn(ln_1(x))`` then ``+ mlp(ln_2(·))``. Attention: QKV as one fused column-parallel layer
(``parts=3``) or three separate ones, heads split over the tensor axis, a row-parallel output projection. MLP:
column → GELU → row. Under sequence parallelism the residual stream is split along the sequence and the norms
declare partial gradients (``SequenceParallel`` or ``partial_grad_specs``). The same classes at tensor size 1 are
the dense reference: every mapping is the identity there, so it is plain torch on the global weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.params import ParamSpecs
from shardspeed.params.assemble import assemble_global
from shardspeed.params.spec import ParamSpec
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.tensor_parallel.sequence import (
    SequenceParallel,
    enter_sequence_parallel,
    leave_sequence_parallel,
    partial_grad_specs,
)
from shardspeed.topology import AxisGroup


def dense_tp() -> TensorParallel:
    """A tensor axis of one rank: the layers compute the dense model."""
    return TensorParallel(AxisGroup("tensor", None, (0,), 0))


class TPMLP(nn.Module):
    """``gathered``: the column layer gathers its output and the row layer slices it again (``gather_output`` +
    ``input_is_parallel=False``: wasteful, but exercises both paths)."""

    def __init__(
        self,
        h: int,
        ffn: int,
        tp: TensorParallel,
        *,
        bias: bool = True,
        layout: str = "out_in",
        gathered: bool = False,
        regather: bool = False,
    ) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(
            h, ffn, tp, bias=bias, weight_layout=layout, gather_output=gathered, regather_input=regather
        )
        self.proj = RowParallelLinear(ffn, h, tp, bias=bias, weight_layout=layout, input_is_parallel=not gathered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TPAttention(nn.Module):
    """Causal self-attention with heads split over the tensor axis (heads divisible by the tensor size)."""

    def __init__(
        self,
        h: int,
        heads: int,
        tp: TensorParallel,
        *,
        fused: bool = True,
        bias: bool = True,
        layout: str = "out_in",
        qkv_bias: bool | None = None,
        regather: bool = False,
    ) -> None:
        super().__init__()
        bias, out_bias = (bias if qkv_bias is None else qkv_bias), bias
        col = {"weight_layout": layout, "regather_input": regather}
        if heads % tp.size:
            raise ValueError(f"{heads} heads cannot be split over {tp.size} tensor ranks")
        self.head_dim, self.local_heads, self.fused = h // heads, heads // tp.size, fused
        if fused:
            self.qkv = ColumnParallelLinear(h, 3 * h, tp, bias=bias, parts=3, **col)
        else:
            self.q = ColumnParallelLinear(h, h, tp, bias=bias, **col)
            self.k = ColumnParallelLinear(h, h, tp, bias=bias, **col)
            self.v = ColumnParallelLinear(h, h, tp, bias=bias, **col)
        self.out = RowParallelLinear(h, h, tp, bias=out_bias, weight_layout=layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # this rank's heads of q, k and v (parts=3)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class TPBlock(nn.Module):
    """``wrap_norms``: the norms as ``SequenceParallel`` wrappers; else the block declares them itself."""

    def __init__(
        self,
        h: int,
        heads: int,
        ffn: int,
        tp: TensorParallel,
        *,
        fused: bool = True,
        bias: bool = True,
        layout: str = "out_in",
        wrap_norms: bool = False,
        qkv_bias: bool | None = None,
        regather: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.ln_1 = SequenceParallel(nn.LayerNorm(h), tp) if wrap_norms else nn.LayerNorm(h)
        self.attn = TPAttention(
            h, heads, tp, fused=fused, bias=bias, layout=layout, qkv_bias=qkv_bias, regather=regather
        )
        self.ln_2 = SequenceParallel(nn.LayerNorm(h), tp) if wrap_norms else nn.LayerNorm(h)
        self.mlp = TPMLP(h, ffn, tp, bias=bias, layout=layout, regather=regather)
        self.wrap_norms = wrap_norms

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        if self.wrap_norms:
            return {}
        return {**partial_grad_specs(self.ln_1, "ln_1", self.tp), **partial_grad_specs(self.ln_2, "ln_2", self.tp)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPTinyLM(nn.Module):
    """GPT-style: embedding (replicated) → enter SP → blocks → leave SP → final norm → replicated head."""

    def __init__(self, tp: TensorParallel, *, vocab: int = 32, h: int = 16, heads: int = 4, ffn: int = 24,
                 layers: int = 2, wrap_norms: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.wte = nn.Embedding(vocab, h)
        # No QKV bias: the k bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by every
        # key), so Adam would turn rounding noise there into full-size steps and no two summation orders agree.
        self.blocks = nn.ModuleList(
            TPBlock(h, heads, ffn, tp, wrap_norms=wrap_norms, qkv_bias=False) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = enter_sequence_parallel(self.wte(ids), self.tp)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(leave_sequence_parallel(x, self.tp)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def load_global(model: nn.Module, dense_state: dict[str, torch.Tensor], tp: TensorParallel) -> None:
    """Copy each parameter's slice of the dense model's global tensor in (the specs say which slice)."""
    specs = ParamSpecs.collect(model, tp.rank, tp.size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(specs.of(p, name).slice_global(dense_state[name], tp.rank, tp.size))


def gather_global(model: nn.Module, tensors: dict[str, torch.Tensor], tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Rebuild global tensors from every tensor rank's local ones (``tensors``: name → local tensor, e.g. grads),
    by all-gathering each rank's local tensor and placing its boxes."""
    import torch.distributed as dist

    specs = ParamSpecs.collect(model, tp.rank, tp.size)
    out = {}
    params = dict(model.named_parameters())
    for name, local in tensors.items():
        spec = specs.of(params[name], name)
        if not spec.partitioned:
            out[name] = local.clone()
            continue
        pieces: list[torch.Tensor | None] = [None] * tp.size
        dist.all_gather_object(pieces, local.detach().clone(), group=tp.axis.group)
        out[name] = assemble_global(spec, pieces)
    return out
