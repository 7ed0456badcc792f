"""``deepspeed.ops.lamb.FusedLamb``: shardspeed's ``optim.Lamb`` with DeepSpeed's constructor and step.

The math is ``optim.Lamb``'s (its docstring says where it differs from DeepSpeed's CUDA kernel). Gradient
clipping belongs to the engine (the config's ``gradient_clipping``), so ``max_grad_norm`` must stay 0 and
``step``'s deprecated ``grads``/``output_params``/``scale``/``grad_norms`` must stay at their defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.optim.lamb import Lamb


class FusedLamb(Lamb):
    """LAMB with DeepSpeed's FusedLamb parameters (in DeepSpeed's order)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant (as in DeepSpeed)")
        if max_grad_norm != 0.0:
            raise ValueError(
                f"FusedLamb: max_grad_norm={max_grad_norm} is not supported; clip with the config's "
                "gradient_clipping (the engine clips the global norm before the step)"
            )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            eps_inside_sqrt=eps_inside_sqrt,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float = 1.0,
        grad_norms: Any = None,
    ) -> float | None:
        if grads is not None or output_params is not None or scale != 1.0 or grad_norms is not None:
            raise RuntimeError(
                "FusedLamb.step: grads/output_params/scale/grad_norms are not supported; call step() with no "
                "arguments (the engine unscales and clips gradients before the optimizer runs)"
            )
        return super().step(closure)
