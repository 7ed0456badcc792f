"""1-bit Adam under ZeRO-1/2: DeepSpeed's OnebitAdam update on the rank's shard, gradients compressed after the
warm-up ([Note: compressed ZeRO gradients] in zero/compressed_grads.py).

Per element, as DeepSpeed's OnebitAdam (no bias correction, whatever ``bias_correction`` says; decoupled weight
decay added to the update; ``eps`` outside the square root, whatever ``eps_inside_sqrt`` says):

  step 1           DeepSpeed's buffer-initialisation call: the step is counted, nothing else changes
  warm-up          m ← β1 m + (1-β1) g;  v ← β2 v + (1-β2) g²;  p ← p - lr (m / (√v + ε) + wd p)
  compressed       m ← β1 m + (1-β1) ĝ;  v frozen;             p ← p - lr (m / (√v + ε) + wd p)

where g is the exact mean gradient (the stage's ordinary reduce-scatter) and ĝ the error-fed 1-bit mean of the
raw local gradients (``GradCompression``; [Note: raw-gradient compression] in zero/compressed_grads.py), both in
gradient units, so clipping and the overflow check act on them as on any gradient.

The switch follows DeepSpeed's: at the end of step t ≥ 2 with t ≥ ``freeze_step`` the
variance freezes and the next step's backward reduces compressed, so step t is compressed iff
t - 1 ≥ max(2, freeze_step). The step count lives in the optimizer state, so a resumed run picks the same phase.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.compression.onebit_adam import adam_moments_, apply_update_, momentum_
from shardspeed.topology import AxisGroup
from shardspeed.zero.compressed_grads import (
    CompressorFactory,
    GradCompression,
    check_compression_combination,
    compressed_optimizer_name,
    default_compressor,
)


def frozen_at(step: int, freeze_step: int) -> bool:
    """Whether step ``step`` (1-based) runs in the compressed phase (its gradients were reduced compressed)."""
    return step - 1 >= max(2, freeze_step)


@torch.no_grad()
def onebit_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    frozen: bool,
) -> None:
    """One OnebitAdam update in place (pure tensor math, no communication): the stage-0 optimizer's own pieces
    (compression/onebit_adam.py), so both paths run DeepSpeed's float operations in DeepSpeed's order."""
    beta1, beta2 = betas
    if frozen:
        momentum_(exp_avg, grad, beta1)
    else:
        adam_moments_(exp_avg, exp_avg_sq, grad, beta1, beta2)
    apply_update_(param, exp_avg, exp_avg_sq, lr, eps, weight_decay)


class ZeroOneBitAdam(torch.optim.Optimizer):
    """OneBitAdam's update on ZeRO shards; DeepSpeed's constructor arguments (``cuda_aware`` and
    ``comm_backend_name`` accepted and unused: the backend is the process group's). ``bind`` gives it the data
    axis; the engine hands ``grad_compression`` to the stage."""

    deepspeed_name = "OneBitAdam"  # compressed_optimizer_name: the combination check
    shardspeed_elementwise = True  # every element's update reads only its own gradient and state

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitAdam does not support amsgrad (as in DeepSpeed)")
        if freeze_step < 0:
            raise ValueError(f"OneBitAdam freeze_step must be >= 0, got {freeze_step}")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.grad_compression: GradCompression | None = None

    @classmethod
    def replacing(cls, optimizer: torch.optim.Optimizer) -> ZeroOneBitAdam:
        """The ZeRO-1/2 form of a (stage-0) OneBitAdam built from the config: same groups and settings."""
        d = optimizer.defaults
        freeze = getattr(optimizer, "freeze_step", d.get("freeze_step", 100000))
        new = cls(
            [dict(g) for g in optimizer.param_groups], lr=d.get("lr", 1e-3), freeze_step=freeze,
            betas=d.get("betas", (0.9, 0.999)), eps=d.get("eps", 1e-8), weight_decay=d.get("weight_decay", 0.0),
        )  # fmt: skip
        return new

    def bind(
        self,
        collectives: Collectives,
        axis: AxisGroup,
        device: torch.device | None = None,
        factory: CompressorFactory = default_compressor,
    ) -> GradCompression:
        """Build the gradient compression over the data axis (engine, once, before the first step)."""
        if device is None:
            device = self.param_groups[0]["params"][0].device
        self.grad_compression = GradCompression(axis, collectives, device, factory)
        self.grad_compression.phase = lambda: self.owns_communication
        return self.grad_compression

    @property
    def steps(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st:
                    return int(st["step"])
        return 0

    @property
    def owns_communication(self) -> bool:
        """True in the compressed phase (the stage's reduce-scatter is then the 1-bit one)."""
        return self.steps >= max(2, self.freeze_step)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                if state["step"] == 1:
                    continue  # DeepSpeed's initialisation call updates nothing
                onebit_adam_update(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], betas=group["betas"],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    frozen=frozen_at(state["step"], self.freeze_step),
                )  # fmt: skip
        return loss

    # --- error buffers in checkpoints (B's protocol) ------------------------------------------------------------
    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's worker error buffers (one per bucket)."""
        return {} if self.grad_compression is None else self.grad_compression.state_dict()

    def load_compression_state_dict(self, sd: dict[str, torch.Tensor], same_world: bool) -> None:
        """Same world size: the saved error buffers; another: reset (the checkpoint reader warns; DeepSpeed
        always resets)."""
        if self.grad_compression is None:
            return
        if same_world:
            self.grad_compression.load_state_dict(sd)
        else:
            self.grad_compression.reset()


def zero_compressed_optimizer(
    optimizer: Any, states: Any, stage: int, axis: AxisGroup, collectives: Collectives, device: torch.device
) -> Any:
    """engine_setup: refuse a 1-bit optimizer at a stage it cannot run with; at stages 1/2 turn OneBitAdam into
    its sharded form and give the stage its gradient compression. Anything else is returned unchanged."""
    check_compression_combination(optimizer, stage)
    if stage not in (1, 2) or compressed_optimizer_name(optimizer) != "OneBitAdam":
        return optimizer
    sharded = optimizer if isinstance(optimizer, ZeroOneBitAdam) else ZeroOneBitAdam.replacing(optimizer)
    states.set_grad_compression(sharded.bind(collectives, axis, device))
    return sharded


def bind_loss_scale(states: Any, scaler: Any) -> None:
    """engine: the stage's gradient compression divides by ``scaler``'s current fp16 loss scale before compressing
    ([Note: transactional error] in zero/compressed_grads.py). Nothing without compression or loss scaling."""
    compression = getattr(states, "compression", None)
    if compression is not None and scaler is not None:
        compression.loss_scale = lambda: scaler.scale
