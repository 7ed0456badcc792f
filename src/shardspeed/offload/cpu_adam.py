"""CPU Adam/AdamW over flat tensors in memory (``cpu_adamw_step``); ``stream.py`` streams it from NVMe.

Why torch's fused kernel: ``torch._fused_adam_`` / ``torch._fused_adamw_`` (CPU since torch 2.4) update
parameter, both moments and read the gradient in one vectorised, multi-threaded pass over memory; the foreach
path makes several passes and allocates temporaries, the per-tensor path more still. An optimizer step on the
CPU is memory-bandwidth bound, so passes over memory are what costs. The foreach math is kept as a fallback for
a torch without the fused CPU kernel; both give torch.optim.Adam/AdamW's update.

Chunks: the flat tensors are cut into ``chunk_numel`` pieces. In memory that only bounds the fallback's
temporaries; for NVMe it is the unit of streaming (``stream.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

DEFAULT_CHUNK_NUMEL = 1 << 22
"""Elements per chunk: 16 MiB of fp32 per tensor, large enough that per-call overhead is noise."""

Kernel = Literal["auto", "fused", "foreach"]
TensorOrList = torch.Tensor | Sequence[torch.Tensor]


def has_fused_cpu_adam() -> bool:
    """Whether this torch has the fused Adam/AdamW kernels (CPU support arrived in torch 2.4)."""
    return hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_")


def _as_list(value: TensorOrList, argument: str) -> list[torch.Tensor]:
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{argument}[{index}] is a {type(tensor).__name__}; valid: a torch.Tensor")
    return tensors


def _check_hyperparameters(step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step = {step!r}; valid: an int ≥ 1 (the step count after this update, as in torch)")
    if not lr >= 0.0:
        raise ValueError(f"lr = {lr!r}; valid: a number ≥ 0")
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas = {betas!r}; valid: two numbers in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"eps = {eps!r}; valid: a number ≥ 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay = {weight_decay!r}; valid: a number ≥ 0")


def _chunks(
    groups: list[list[torch.Tensor]], names: tuple[str, ...], chunk_numel: int
) -> tuple[list[torch.Tensor], ...]:
    """Cut each of the parallel tensor lists into matching 1-D chunk views."""
    out: tuple[list[torch.Tensor], ...] = tuple([] for _ in groups)
    for index, members in enumerate(zip(*groups)):
        reference = members[0]
        for name, tensor in zip(names, members):
            if tensor.shape != reference.shape or tensor.dtype != reference.dtype or tensor.device != reference.device:
                raise ValueError(
                    f"{name}[{index}] is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} but params[{index}] "
                    f"is {tuple(reference.shape)} {reference.dtype} on {reference.device}; they must match"
                )
            if not tensor.is_contiguous() or not tensor.is_floating_point():
                raise ValueError(f"{name}[{index}]: valid: a contiguous floating-point tensor")
        flats = [tensor.view(-1) for tensor in members]
        for start in range(0, reference.numel(), chunk_numel):
            for target, flat in zip(out, flats):
                target.append(flat[start : start + chunk_numel])
    return out


def _foreach_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
) -> None:
    """Adam's update with torch's foreach kernels: the fallback when the fused CPU kernel is missing."""
    beta1, beta2 = betas
    if weight_decay != 0.0:
        if adam_w_mode:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)  # decoupled: shrink the weights directly
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)  # L2: decay enters through the gradient
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominators, math.sqrt(1.0 - beta2**step))
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, -step_size)


def cpu_adamw_step(
    params: TensorOrList,
    grads: TensorOrList,
    exp_avgs: TensorOrList,
    exp_avg_sqs: TensorOrList,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    kernel: Kernel = "auto",
) -> None:
    """One Adam (``adam_w_mode=False``, L2 decay) or AdamW (decoupled decay) step, in place, chunk by chunk.

    Each argument is a tensor or a list of tensors (matching shapes, dtypes and device, contiguous);
    ``step`` is the step count including this update (1 on the first step), as torch's optimizers count.
    ``kernel``: "fused" (torch's fused CPU kernel), "foreach" (the fallback math) or "auto" (fused when present).
    """
    _check_hyperparameters(step, lr, betas, eps, weight_decay)
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(f"chunk_numel = {chunk_numel!r}; valid: a positive number of elements")
    if kernel not in ("auto", "fused", "foreach"):
        raise ValueError(f"kernel = {kernel!r}; valid: 'auto', 'fused' or 'foreach'")
    on_cpu = all(t.device.type == "cpu" for t in _as_list(params, "params"))
    # the fused kernel's CPU build is what this module targets; accelerator tensors (the part of the state
    # offload_optimizer.ratio keeps on the device) take the device-agnostic foreach math
    use_fused = kernel == "fused" or (kernel == "auto" and has_fused_cpu_adam() and on_cpu)
    if use_fused and not has_fused_cpu_adam():
        raise RuntimeError(f"kernel='fused' needs torch ≥ 2.4 (torch._fused_adamw_); this is torch {torch.__version__}")
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs")
    groups = [_as_list(value, name) for value, name in zip((params, grads, exp_avgs, exp_avg_sqs), names)]
    lengths = {len(group) for group in groups}
    if len(lengths) != 1:
        raise ValueError(f"params, grads, exp_avgs, exp_avg_sqs have {[len(g) for g in groups]} tensors; must match")
    chunked = _chunks(groups, names, chunk_numel)
    hyper = {"lr": lr, "weight_decay": weight_decay, "eps": eps}
    if not use_fused:
        _foreach_adam(*chunked, step=step, betas=betas, adam_w_mode=adam_w_mode, **hyper)
        return
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    step_tensor = torch.tensor(float(step), dtype=torch.float32)  # torch's fused optimizers count in fp32
    for p, g, m, v in zip(*chunked):
        fused(
            [p],
            [g],
            [m],
            [v],
            [],
            [step_tensor],
            beta1=betas[0],
            beta2=betas[1],
            amsgrad=False,
            maximize=False,
            **hyper,
        )
