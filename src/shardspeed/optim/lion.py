"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675).

Per parameter ``w`` with gradient ``g``::

    c = b1*m + (1-b1)*g                        (interpolation used for the update direction)
    w = w * (1 - lr*weight_decay) - lr * sign(c)   (decoupled weight decay, as in AdamW)
    m = b2*m + (1-b2)*g                        (momentum tracked with the slower b2)

Every element's update depends only on that element's gradient and momentum, so Lion is element-wise and
shards freely. It keeps one state tensor (half of Adam's). Defaults follow DeepSpeed's ``Lion`` config type
(lr=1e-3, betas=(0.9, 0.99), weight_decay=0); the paper recommends a 3-10x smaller lr than AdamW's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """EvoLved Sign Momentum. See the module docstring for the math."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"Lion: betas must each be in [0, 1], got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Lion update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                direction = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
                if weight_decay != 0.0:
                    param.mul_(1.0 - lr * weight_decay)
                param.add_(direction, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss
