"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: Adam/AdamW on host-resident parameters, DeepSpeed's constructor.

The step is shardspeed's CPU Adam (``offload.cpu_adam.cpu_adamw_step``: torch's fused, multi-threaded kernel),
the same one the engine's ``offload_optimizer`` uses. ``fp32_optimizer_states`` (default True) keeps the moments
in fp32 for bf16/fp16 parameters; the update is then computed in fp32 and written back (``ops/adam/update.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.ops.adam.update import adam_group_step, check_adam_args


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``) or AdamW (default) for parameters in host memory."""

    optimizer_id = 0  # DeepSpeed numbers its instances (its C++ side keys state by this id); kept for parity

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        check_adam_args("DeepSpeedCPUAdam", lr, eps, weight_decay, betas, amsgrad)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "amsgrad": amsgrad,
        }
        super().__init__(model_params, defaults)
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.device.type != "cpu":
                    raise RuntimeError(
                        f"DeepSpeedCPUAdam: a parameter is on {param.device}; it must be on the CPU (for optimizer "
                        "states in host memory with parameters on the device, use the config's "
                        "zero_optimization.offload_optimizer)"
                    )
            state_dtype = torch.float32 if self.fp32_optimizer_states else None
            adam_group_step(group, self.state, self.adam_w_mode, state_dtype=state_dtype)
        return loss
