"""FLOP formulas ``torch.utils.flop_counter.FlopCounterMode`` lacks, given to it through ``custom_mapping``.

On CPU, ``F.scaled_dot_product_attention`` dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` (and
its ``_backward``), which torch's registry does not know: the mode counts attention as 0 FLOPs. Other backends use
``aten._scaled_dot_product_fused_attention_overrideable`` (also unregistered). With dropout or an explicit float
mask the math path runs as ``bmm`` ops, which torch counts already. We map the missing ops here, per mode
(``custom_mapping``), so nothing process-wide in torch is modified.

[Note: the causal rule] A causal mask is counted as the **full** ``s_q × s_k`` score matrix, like torch's own
formulas for the CUDA flash / efficient / cuDNN kernels: forward ``4·b·h·s_q·s_k·d`` (``QKᵀ`` and ``PV``). This
is the convention of the usual "6·N·T + 12·L·s·d·T" transformer estimate, so the profiler's total for a decoder
can be checked exactly against it; a causal kernel does about half of that work.

[Note: attention backward is 2× forward] The backward is counted as its four matmuls (``dV = Pᵀ dO``,
``dP = dO Vᵀ``, ``dQ = dS K``, ``dK = dSᵀ Q``), 2× the forward: the model's FLOPs. A flash kernel also recomputes
``QKᵀ`` in backward (torch's registered formulas count that fifth matmul, 2.5× forward); we override those entries
too, so every SDPA backend gives the same figure and ``fwd + bwd = 3 × fwd`` holds for attention as for linears.

[Note: the fused fast paths] In eval mode without grad, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``
run as single fused ops (``aten._native_multi_head_attention``, ``aten._transformer_encoder_layer_fwd``) torch does
not count. They are mapped to the sum of what the unfused path counts: the q/k/v in-projections, attention by the
causal rule, the out-projection, and for the encoder layer the two FFN linears; so a module's figure does not
depend on the path taken (norms and activations count 0 as always).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten

Shape = Sequence[int]


def sdpa_forward_flops(query_shape: Shape, key_shape: Shape, value_shape: Shape) -> int:
    """``QKᵀ`` then ``PV``, full score matrix ([Note: the causal rule]); grouped-query heads broadcast."""
    b, h, s_q, d_q = query_shape
    s_k = key_shape[-2]
    d_v = value_shape[-1]
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


def sdpa_backward_flops(query_shape: Shape, key_shape: Shape, value_shape: Shape) -> int:
    """The four backward matmuls, 2× the forward ([Note: attention backward is 2× forward])."""
    return 2 * sdpa_forward_flops(query_shape, key_shape, value_shape)


def _forward(query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, **kwargs: Any) -> int:
    return sdpa_forward_flops(query_shape, key_shape, value_shape)


def _backward(grad_out: Shape, query_shape: Shape, key_shape: Shape, value_shape: Shape, *a: Any, **k: Any) -> int:
    return sdpa_backward_flops(query_shape, key_shape, value_shape)


def _linear(tokens: int, n_in: int, n_out: int) -> int:
    return 2 * tokens * n_in * n_out


def _mha_flops(query_shape: Shape, key_shape: Shape, embed_dim: int) -> int:
    """Batch-first ``(b, s, E)`` or unbatched ``(s, E)`` inputs ([Note: the fused fast paths])."""
    b = query_shape[0] if len(query_shape) == 3 else 1
    s_q, s_k = query_shape[-2], key_shape[-2]
    projections = _linear(b * s_q, embed_dim, embed_dim) * 2 + _linear(b * s_k, embed_dim, embed_dim) * 2
    return projections + 4 * b * s_q * s_k * embed_dim


def _native_mha(query_shape: Shape, key_shape: Shape, value_shape: Shape, embed_dim: int, *a: Any, **k: Any) -> int:
    return _mha_flops(query_shape, key_shape, embed_dim)


def _encoder_layer(src_shape: Shape, embed_dim: int, num_heads: int, *args: Any, **kwargs: Any) -> int:
    ffn_weight_1 = args[11]  # (ffn, E), after qkv/proj weights+biases, use_gelu, norm_first, eps and the norms
    tokens = src_shape[0] * src_shape[1] if len(src_shape) == 3 else src_shape[0]
    ffn = _linear(tokens, embed_dim, ffn_weight_1[0]) + _linear(tokens, ffn_weight_1[0], embed_dim)
    return _mha_flops(src_shape, src_shape, embed_dim) + ffn


def _ops(*names: str) -> list[Any]:
    """The overload packets that exist in this torch build (a backend-specific op may be absent)."""
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


SDPA_FORWARD_OPS = _ops(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
SDPA_BACKWARD_OPS = _ops(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)


def custom_mapping() -> dict[Any, Callable[..., int]]:
    """``FlopCounterMode(custom_mapping=...)``: op packet → formula over argument shapes."""
    mapping: dict[Any, Callable[..., int]] = {op: _forward for op in SDPA_FORWARD_OPS}
    mapping.update({op: _backward for op in SDPA_BACKWARD_OPS})
    mapping.update({op: _native_mha for op in _ops("_native_multi_head_attention")})
    mapping.update({op: _encoder_layer for op in _ops("_transformer_encoder_layer_fwd")})
    return mapping
