"""DeepSpeed's ``WarmupLR`` (warm up, then hold) and ``WarmupDecayLR`` (warm up, then linear decay).

With ``n = max(2, warmup_num_steps)`` (DeepSpeed floors at 2 so the log warmup never divides by log 1 = 0)
and ``step`` the scheduler's index (-1 at construction, see ``schedulers.base``)::

    fraction(step) = 0                                   step < 0
                   = log(step + 1) / log(n)              step < n, warmup_type "log"
                   = step / n                            step < n, warmup_type "linear"
                   = 1                                   step >= n                (WarmupLR)
                   = max(0, (total - step) / max(1, total - n))   step >= n       (WarmupDecayLR)
    lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * fraction

So WarmupDecayLR decays linearly back to ``warmup_min_lr`` (not 0) at ``total_num_steps``.

``warmup_max_lr`` left out means "each param group's own lr at construction", i.e. the optimizer's lr.
DeepSpeed does this for WarmupLR (since 0.17) using the first group's lr for every group; we use each
group's own lr, and do the same for WarmupDecayLR (where DeepSpeed still falls back to a fixed 0.001 that
silently overrides the optimizer's lr).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from shardspeed.optim.param_checks import (
    REQUIRED,
    ParamSpec,
    check_choice,
    check_int,
    check_number_or_list,
    optional,
)
from shardspeed.schedulers.base import BatchLRScheduler, group_lrs, per_group

logger = logging.getLogger(__name__)

WARMUP_TYPES: tuple[str, ...] = ("log", "linear")


def effective_warmup_steps(warmup_num_steps: int) -> int:
    """DeepSpeed's floor of 2 warmup steps (keeps ``log(n)`` non-zero); used by every warmup curve."""
    return max(2, warmup_num_steps)


def warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str = "log") -> float:
    """How far warmup has gone at ``step``: 0 at (and before) step 0, 1 from step ``n`` on."""
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
    if step < 0:
        return 0.0
    n = effective_warmup_steps(warmup_num_steps)
    if step >= n:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(n)
    return step / n


def warmup_lr_at(
    step: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> float:
    """WarmupLR's lr at ``step``: min -> max over the warmup, then held at max."""
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * warmup_fraction(step, warmup_num_steps, warmup_type)


def warmup_decay_lr_at(
    step: int,
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> float:
    """WarmupDecayLR's lr at ``step``: min -> max over the warmup, then linearly back to min at the end."""
    n = effective_warmup_steps(warmup_num_steps)
    if step < n:
        fraction = warmup_fraction(step, warmup_num_steps, warmup_type)
    else:
        fraction = max(0.0, (total_num_steps - step) / max(1, total_num_steps - n))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * fraction


LAST_BATCH_ITERATION_SPEC = ParamSpec(partial(check_int, minimum=-1), -1)
WARMUP_NUM_STEPS_SPEC = ParamSpec(partial(check_int, minimum=1), 1000)
WARMUP_TYPE_SPEC = ParamSpec(partial(check_choice, choices=WARMUP_TYPES), "log")
_LR = partial(check_number_or_list, minimum=0.0)

WARMUP_LR_SPEC: dict[str, ParamSpec] = {
    "warmup_min_lr": ParamSpec(_LR, 0.0),
    "warmup_max_lr": ParamSpec(optional(_LR)),  # absent or null: each group's own lr
    "warmup_num_steps": WARMUP_NUM_STEPS_SPEC,
    "warmup_type": WARMUP_TYPE_SPEC,
    "last_batch_iteration": LAST_BATCH_ITERATION_SPEC,
}
WARMUP_DECAY_LR_SPEC: dict[str, ParamSpec] = {
    "total_num_steps": ParamSpec(partial(check_int, minimum=1), REQUIRED),
    **WARMUP_LR_SPEC,
}


def warn_if_total_below_warmup(total_num_steps: int, warmup_num_steps: int) -> None:
    """DeepSpeed accepts (and warns about) a schedule that ends before its warmup does; so do we."""
    if total_num_steps < warmup_num_steps:
        logger.warning(
            "scheduler: total_num_steps (%d) is less than warmup_num_steps (%d); the schedule ends before warmup does",
            total_num_steps,
            warmup_num_steps,
        )


class WarmupLR(BatchLRScheduler):
    """DeepSpeed's WarmupLR: min -> max lr over ``warmup_num_steps`` (log or linear), then constant."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        num_groups = len(optimizer.param_groups)
        self.warmup_num_steps = check_int(warmup_num_steps, "warmup_num_steps", minimum=1)
        self.warmup_type = check_choice(warmup_type, "warmup_type", choices=WARMUP_TYPES)
        self.min_lrs = per_group(warmup_min_lr, num_groups, "warmup_min_lr")
        self._max_lrs_inherited = warmup_max_lr is None
        if warmup_max_lr is None:
            self.max_lrs = group_lrs(optimizer)
        else:
            self.max_lrs = per_group(warmup_max_lr, num_groups, "warmup_max_lr")
        if type(self) is WarmupLR:
            self._start()

    def lrs_at(self, step: int) -> list[float]:
        return [
            warmup_lr_at(step, low, high, self.warmup_num_steps, self.warmup_type)
            for low, high in zip(self.min_lrs, self.max_lrs)
        ]

    def state_dict(self) -> dict[str, Any]:
        # Inherited max lrs came from the optimizer at construction; save them so a resume that rebuilds
        # the scheduler after the optimizer's lr was restored (mid-schedule) does not warm up to that lr.
        state = super().state_dict()
        if self._max_lrs_inherited:
            state["max_lrs"] = list(self.max_lrs)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._max_lrs_inherited and "max_lrs" in state_dict:
            self.max_lrs = [float(lr) for lr in state_dict["max_lrs"]]
        super().load_state_dict(state_dict)


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then linear decay to ``warmup_min_lr`` at
    ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = check_int(total_num_steps, "total_num_steps", minimum=1)
        warn_if_total_below_warmup(self.total_num_steps, self.warmup_num_steps)
        self._start()

    def lrs_at(self, step: int) -> list[float]:
        return [
            warmup_decay_lr_at(step, self.total_num_steps, low, high, self.warmup_num_steps, self.warmup_type)
            for low, high in zip(self.min_lrs, self.max_lrs)
        ]
