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
    return mapping
