"""``deepspeed.ops.adam.FusedAdam``: Adam/AdamW with DeepSpeed's constructor, on any device, no build step.

DeepSpeed's FusedAdam is a CUDA multi-tensor kernel; here the update is ``offload.cpu_adam.cpu_adamw_step``
(torch's fused kernel on CPU, torch's foreach math on CUDA), which equals ``torch.optim.AdamW``
(``adam_w_mode=True``, the default) or ``torch.optim.Adam`` (``adam_w_mode=False``, L2 decay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.ops.adam.update import adam_group_step, check_adam_args


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``) or AdamW (default) with DeepSpeed's FusedAdam parameters."""

    shardspeed_elementwise = True  # each element's update reads only its own gradient and moments (ZeRO shards it)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        check_adam_args("FusedAdam", lr, eps, weight_decay, betas, amsgrad)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """DeepSpeed's ``set_grad_none`` decides unless the caller says otherwise."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
        grad_scaler: Any = None,
    ) -> float | None:
        """One update. The extra arguments are DeepSpeed's deprecated ones: accepted only as None."""
        if any(value is not None for value in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError(
                "FusedAdam.step: grads/output_params/scale/grad_norms/grad_scaler are deprecated (as in DeepSpeed); "
                "call step() with no arguments"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            adam_group_step(group, self.state, self.adam_w_mode, state_dtype=None)
        return loss
