"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", arXiv 1904.00962).

Per parameter tensor ``w`` with gradient ``g``, at step ``t``::

    m = b1*m + (1-b1)*g              v = b2*v + (1-b2)*g^2
    m_hat = m / (1-b1^t)             v_hat = v / (1-b2^t)        (only with bias_correction)
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w           (eps_inside_sqrt: sqrt(v_hat + eps))
    trust = clamp(||w|| / ||r||, min_coeff, max_coeff), or 1 when either norm is 0
    w = w - lr * trust * r

The trust ratio is a *per-tensor* norm ratio, so LAMB is not element-wise: a shard of a tensor cannot
compute its own update without the norms of the whole tensor (``is_elementwise`` says False for it).

Parameter names and defaults follow DeepSpeed's ``Lamb`` config type (``max_coeff=10``, ``min_coeff=0.01``
clamp the trust ratio). One deliberate difference from DeepSpeed's fused CUDA kernel: that kernel computes
the trust ratio on the update *before* bias correction and then multiplies the step by the bias-correction
factor; we follow the paper, where bias correction sits inside ``r`` (so it largely cancels in the trust
ratio). The two agree once ``1 - b^t`` is close to 1, i.e. after the first few hundred steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB) with a clamped trust ratio; the math is in the module docstring."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must each be in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb: eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
        if not (0.0 < min_coeff <= max_coeff):
            raise ValueError(f"Lamb: need 0 < min_coeff <= max_coeff, got min={min_coeff}, max={max_coeff}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self._update_one(param, group)
        return loss

    def _update_one(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        update = self._direction(param, group)
        # Norms stay tensors and the fallback is a torch.where, so there is no host sync per parameter.
        # Norms in at least fp32: a bf16/fp16 sum of squares over a large tensor loses the ratio's precision.
        norm_dtype = torch.promote_types(param.dtype, torch.float32)
        weight_norm = torch.linalg.vector_norm(param, dtype=norm_dtype)
        update_norm = torch.linalg.vector_norm(update, dtype=norm_dtype)
        trust = trust_ratio(weight_norm, update_norm, group)
        param.sub_(update * (trust.to(update.dtype) * group["lr"]))

    def _direction(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the moments of ``param`` and return its update ``r`` (element-wise; no norms yet)."""
        grad = param.grad
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

        if group["bias_correction"]:
            m_hat = exp_avg / (1.0 - beta1**step)
            v_hat = exp_avg_sq / (1.0 - beta2**step)
        else:
            m_hat, v_hat = exp_avg, exp_avg_sq
        if group["eps_inside_sqrt"]:
            denom = (v_hat + group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt().add_(group["eps"])
        update = m_hat / denom
        if group["weight_decay"] != 0.0:
            update.add_(param, alpha=group["weight_decay"])
        return update


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """clamp(||w|| / ||r||, min_coeff, max_coeff), and 1 where either norm is 0 (element-wise over tensors)."""
    ratio = (weight_norm / update_norm).clamp_(group["min_coeff"], group["max_coeff"])
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))
