"""1-bit LAMB (Li et al. 2021, arXiv 2104.06069), DeepSpeed's ``OnebitLamb`` on any backend.

Per parameter, with DeepSpeed's step counter ``s`` (no bias correction)::

    warm-up (s < freeze_step), g = exact mean of the gradients (the engine all-reduces):
        m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  (at s == freeze_step: v_fresh = v)
        u = m / (sqrt(v) + eps) + weight_decay * w
        c = clamp(||w|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
        c_frozen = coeff_beta * c_frozen + (1-coeff_beta) * c      (skipped when c == 1, as DeepSpeed does)
        w -= lr * c * u
    compression (after freeze_step; v frozen), g = the local gradient:
        at the first compressed step: k_p = mean_q(||m_q|| / sqrt(n_q)) / (||m_p|| / sqrt(n_p))
        m = (b1*m + (1-b1)*g) * k_p;  m = 1-bit compressed mean of all momenta as one flat bucket;  m = m / k_p
        g~ = (m - b1*m_prev) / (1-b1);  v_fresh = b2*v_fresh + (1-b2)*g~^2
        u0 = m / (sqrt(v) + eps);  u = u0 + weight_decay * w
        f = max(d / d_fresh) with d = sqrt(v) + eps, d_fresh = sqrt(v_fresh) + eps
            (weight decay: r = min(1, ||u0|| / ||u||),  f = f*r + (1-r))
        f clamped to [factor_min, factor_max], then to last_f * [1 - factor_threshold, 1 + factor_threshold]
        w -= lr * (c_frozen * f) * u

``k_p`` (``scaling_coeff``) brings every tensor's momentum to one scale before the single flat compression,
so one sign scale fits them all. The first step only creates the states ([Note: DeepSpeed's first step]
in ``zero_one_adam.py``), so the warm-up has ``freeze_step - 1`` updates, as in DeepSpeed. Deliberate
differences: the error buffers, ``lamb_coeff_freeze``, ``last_factor`` and ``scaling_coeff`` survive a
checkpoint (DeepSpeed resets the errors, and in the warm-up the coefficient EMA, on load); a tensor whose
momentum is exactly zero at the freeze gets ``k_p = 1`` (DeepSpeed divides by zero); a parameter without
``.grad`` counts as a zero gradient in both stages (it still moves by momentum and weight decay, and its
``step`` advances, so every rank compresses the same bucket; DeepSpeed skips it in the warm-up, and in the
compression stage skips its momentum update but still divides it by ``scaling_coeff``); AMSGrad is not supported.
A param group's ``exp_avg_mask`` multiplies the averaged momentum in the compression stage, as in DeepSpeed.

Communication ([Note: optimizer-owned means] in ``owned_comm.py``): the engine all-reduces gradients in the
warm-up (``owns_communication`` is False) and hands local gradients over once the compression starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.compression.onebit_adam import check_comm_backend_name
from shardspeed.compression.optim_base import mask_exp_avg_, trained
from shardspeed.compression.owned_comm import MeanCommOptimizer


def lamb_trust_ratio(weight_norm: float, update_norm: float, min_coeff: float, max_coeff: float) -> float:
    """DeepSpeed's warm-up coefficient: ``||w|| / ||u||`` clamped, or 1.0 when either norm is zero."""
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    return min(max(weight_norm / update_norm, min_coeff), max_coeff)


def coefficient_ema(frozen: float, coeff: float, coeff_beta: float) -> float:
    """The tracked coefficient the compression stage scales by (a coefficient of exactly 1 is not tracked)."""
    return frozen if coeff == 1.0 else coeff_beta * frozen + (1 - coeff_beta) * coeff


def scaling_coefficients(momentum_scales: list[float]) -> list[float]:
    """``k_p`` per tensor from ``||m_p|| / sqrt(n_p)``: the mean scale over the tensor's own (1 for a zero momentum)."""
    united = sum(momentum_scales) / len(momentum_scales)
    return [united / scale if scale != 0 else 1.0 for scale in momentum_scales]


def clamp_factor(
    factor: float, last_factor: float, factor_min: float, factor_max: float, factor_threshold: float
) -> float:
    """The compression-stage factor, clamped to [min, max] and then to ``last * (1 ± threshold)``."""
    factor = min(max(factor, factor_min), factor_max)
    factor = min(factor, last_factor * (1.0 + factor_threshold))
    return max(factor, last_factor * (1.0 - factor_threshold))


def compression_factor(
    denom: torch.Tensor, denom_fresh: torch.Tensor, update_prelim: torch.Tensor, update: torch.Tensor, decays: bool
) -> float:
    """The raw factor ``max(d / d_fresh)``, blended towards 1 by the weight-decay share of the update."""
    factor = (denom / denom_fresh).max().item()
    if decays:
        ratio = min(1.0, (update_prelim.norm() / update.norm()).item())
        factor = factor * ratio + (1.0 - ratio)
    return factor


class OneBitLamb(MeanCommOptimizer):
    """1-bit LAMB with DeepSpeed's parameter names and defaults; the math is in the module docstring."""

    shardspeed_elementwise = False  # per-tensor norms and one flat compression over every tensor

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        amsgrad: bool = False,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        max_grad_norm: float = 0.0,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitLamb has no AMSGrad variant (DeepSpeed refuses it too)")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"OneBitLamb: lr, eps, weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"OneBitLamb: betas must each be in [0, 1), got {betas}")
        if not (0.0 < min_coeff <= max_coeff):
            raise ValueError(f"OneBitLamb: need 0 < min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        if not (0.0 < factor_min <= factor_max):
            raise ValueError(f"OneBitLamb: need 0 < factor_min <= factor_max, got {factor_min}, {factor_max}")
        if not (0.0 <= coeff_beta < 1.0) or factor_threshold < 0.0:
            raise ValueError(
                f"OneBitLamb: need 0 <= coeff_beta < 1, factor_threshold >= 0: {coeff_beta}, {factor_threshold}"
            )
        if int(freeze_step) != freeze_step or freeze_step < 0:
            raise ValueError(f"OneBitLamb: freeze_step must be an integer >= 0, got {freeze_step}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.cuda_aware = cuda_aware  # accepted for DeepSpeed configs; Collectives picks the transport
        self.comm_backend_name = check_comm_backend_name(comm_backend_name)
        # DeepSpeed accepts these and never reads them (no bias correction, eps outside the root): so do we.
        self.bias_correction, self.eps_inside_sqrt = bias_correction, eps_inside_sqrt
        self.max_grad_norm = max_grad_norm  # accepted and never read, as in DeepSpeed (clipping: the engine's)
        self.lamb_coeffs: list[float] = []

    # -- engine protocol -------------------------------------------------------------------------------------
    @property
    def compressing(self) -> bool:
        """Whether the next step is a compression-stage step (DeepSpeed's ``lamb_freeze_key``)."""
        return self._counter() >= max(self.freeze_step, 2)  # DeepSpeed always runs one warm-up step

    @property
    def owns_communication(self) -> bool:
        return self.compressing

    def get_lamb_coeffs(self) -> list[float]:
        """The coefficients the last step applied, one per tensor (DeepSpeed's accessor)."""
        return list(self.lamb_coeffs)

    # -- state -----------------------------------------------------------------------------------------------
    def _members(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in trained(g["params"]) if p.numel() > 0]

    def _counter(self) -> int:
        for _, p in self._members():
            state = self.state.get(p)
            return int(state["step"]) if state else 0
        return 0

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
            state["lamb_coeff_freeze"] = 0.0
            state["last_factor"] = 1.0
            for name in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    # -- step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Empty tensors are skipped (DeepSpeed filters them: their scale would be 0/0); a missing gradient
        # counts as zero so every rank compresses the same bucket.
        members = self._members()
        if not members:
            return loss
        compressing = self.compressing
        self.lamb_coeffs = []
        grads = [
            p.grad.detach().to(torch.float32, copy=True)
            if p.grad is not None
            else torch.zeros_like(p, dtype=torch.float32)
            for _, p in members
        ]
        states = [self._state(p) for _, p in members]
        if states[0]["step"] == 0:  # [Note: DeepSpeed's first step] in zero_one_adam.py: states only
            for state in states:
                state["step"] = 1
            return loss
        if compressing:
            self._compressed_step(members, grads, states)
        else:
            self._warmup_step(members, grads, states)
        return loss

    def _warmup_step(self, members: list[Any], grads: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        for (group, p), grad, state in zip(members, grads, states, strict=True):
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if state["step"] == self.freeze_step:
                state["exp_avg_sq_fresh"].copy_(exp_avg_sq)
            update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p
            coeff = lamb_trust_ratio(p.norm().item(), update.norm().item(), group["min_coeff"], group["max_coeff"])
            state["lamb_coeff_freeze"] = coefficient_ema(state["lamb_coeff_freeze"], coeff, self.coeff_beta)
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _compressed_step(self, members: list[Any], grads: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        if any("scaling_coeff" not in state for state in states):
            scales = [(s["exp_avg"].norm() / math.sqrt(s["exp_avg"].numel())).item() for s in states]
            for state, k in zip(states, scaling_coefficients(scales), strict=True):
                state["scaling_coeff"] = k
        last = [state["exp_avg"].clone() for state in states]
        for (group, _), grad, state in zip(members, grads, states, strict=True):
            beta1 = group["betas"][0]
            state["step"] += 1
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1).mul_(state["scaling_coeff"])
        # One flat bucket over every momentum: one scale per rank chunk, one pair of error buffers.
        flat = torch.cat([state["exp_avg"].reshape(-1).float() for state in states])
        self.comm.compressed_mean("momentum", flat)
        offset = 0
        for (group, p), state, previous in zip(members, states, last, strict=True):
            exp_avg = state["exp_avg"]
            exp_avg.copy_(flat[offset : offset + exp_avg.numel()].view_as(exp_avg))
            offset += exp_avg.numel()
            self._compressed_update(group, p, state, previous)

    def _compressed_update(
        self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], previous: torch.Tensor
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        exp_avg.div_(state["scaling_coeff"])
        mask_exp_avg_(group, exp_avg)  # DeepSpeed: after the compressed mean, on any number of ranks
        reconstructed = (exp_avg - previous * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(reconstructed, reconstructed, value=1 - beta2)
        denom = exp_avg_sq.sqrt() + group["eps"]
        update_prelim = exp_avg / denom
        decays = group["weight_decay"] > 0.0
        update = update_prelim + group["weight_decay"] * p if decays else update_prelim
        raw = compression_factor(denom, fresh.sqrt() + group["eps"], update_prelim, update, decays)
        factor = clamp_factor(raw, state["last_factor"], self.factor_min, self.factor_max, self.factor_threshold)
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)
