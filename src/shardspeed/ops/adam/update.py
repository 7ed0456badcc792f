"""The Adam/AdamW update both DeepSpeed-named Adam classes share: one call per parameter group.

Fast path: ``offload.cpu_adam.cpu_adamw_step`` (torch's fused Adam kernel on CPU, its foreach math elsewhere) —
the same update as ``torch.optim.AdamW`` / ``Adam``. It needs parameter, gradient and moments in one dtype and
bias correction on. Otherwise (``bias_correction=False``, or fp32 moments for a bf16/fp16 parameter) the update
is computed here in fp32 per tensor, with the same formula as torch's::

    w -= lr*wd*w (AdamW) | g += wd*w (Adam)     m = b1*m + (1-b1)*g     v = b2*v + (1-b2)*g^2
    w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)        (bias correction off: both factors are 1)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardspeed.offload.cpu_adam import cpu_adamw_step


def check_adam_args(
    name: str, lr: float, eps: float, weight_decay: float, betas: tuple[float, float], amsgrad: bool
) -> None:
    """The argument checks DeepSpeed's Adam classes make, with the class named in each error."""
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant (as in DeepSpeed); use torch.optim.AdamW")
    if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
        raise ValueError(f"{name}: lr, eps, weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{name}: betas must each be in [0, 1), got {betas}")


def init_state(state: dict[str, Any], param: torch.Tensor, state_dtype: torch.dtype) -> None:
    """DeepSpeed's state keys: ``step`` and the two moments ``exp_avg`` / ``exp_avg_sq``."""
    state["step"] = 0
    state["exp_avg"] = torch.zeros_like(param, dtype=state_dtype, memory_format=torch.contiguous_format)
    state["exp_avg_sq"] = torch.zeros_like(param, dtype=state_dtype, memory_format=torch.contiguous_format)


def _reference_update(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], adam_w_mode: bool
) -> None:
    """One tensor, computed in fp32 (moments in their own dtype); see the module docstring."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    step = state["step"]
    weights = param.detach().float()
    grad = grad.float()
    if weight_decay != 0.0:
        if adam_w_mode:
            weights.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(weights, alpha=weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad.to(exp_avg.dtype), 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad.to(exp_avg_sq.dtype), grad.to(exp_avg_sq.dtype), value=1.0 - beta2)
    correction1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
    correction2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
    denominator = (exp_avg_sq.float().sqrt() / math.sqrt(correction2)).add_(eps)
    weights.addcdiv_(exp_avg.float(), denominator, value=-lr / correction1)
    param.detach().copy_(weights)


@torch.no_grad()
def adam_group_step(
    group: dict[str, Any], states: dict[torch.Tensor, Any], adam_w_mode: bool, state_dtype: Any
) -> None:
    """Step every parameter of ``group`` that has a gradient. ``state_dtype`` None: moments in the parameter's
    dtype; else that dtype (DeepSpeedCPUAdam's ``fp32_optimizer_states``)."""
    fast: dict[tuple[torch.dtype, torch.device, int], list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]] = {}
    for param in group["params"]:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            raise RuntimeError("Adam does not support sparse gradients; use torch.optim.SparseAdam")
        state = states[param]
        if len(state) == 0:
            init_state(state, param, state_dtype or param.dtype)
        state["step"] += 1
        same_dtype = state["exp_avg"].dtype == param.dtype == param.grad.dtype
        if group["bias_correction"] and same_dtype and param.is_contiguous() and param.grad.is_contiguous():
            fast.setdefault((param.dtype, param.device, state["step"]), []).append((param, param.grad, state))
        else:
            _reference_update(param, param.grad, state, group, adam_w_mode)
    for (_, _, step), members in fast.items():
        cpu_adamw_step(
            [p.detach() for p, _, _ in members],
            [g for _, g, _ in members],
            [s["exp_avg"] for _, _, s in members],
            [s["exp_avg_sq"] for _, _, s in members],
            step=step,
            lr=group["lr"],
            betas=tuple(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=adam_w_mode,
        )
