"""DeepSpeed's ``WarmupCosineLR``: a ratio schedule applied to each param group's own base lr.

With ``n = max(2, warmup_num_steps)`` and ``step`` the scheduler index (-1 at construction)::

    ratio(step) = 0                                                    step < 0
                = warmup_min_ratio + (1 - warmup_min_ratio) * f(step)  step < n   (f: log/linear warmup)
                = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)   otherwise,
                  p = min(1, (step - n + 1) / max(1, total_num_steps - n))
    lr_group = base_lr_group * ratio

Note the ratio is 0 at construction, as in DeepSpeed: the first optimizer step runs with lr 0 and the
warmup proper starts at the second (``warmup_min_ratio`` applies from index 0). The cosine progress is
clamped at 1 so the lr stays at ``cos_min_ratio`` after ``total_num_steps`` (current DeepSpeed does the same).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from shardspeed.optim.param_checks import REQUIRED, ParamSpec, check_int, check_number
from shardspeed.schedulers.base import BatchLRScheduler, group_lrs
from shardspeed.schedulers.warmup import (
    LAST_BATCH_ITERATION_SPEC,
    WARMUP_NUM_STEPS_SPEC,
    WARMUP_TYPE_SPEC,
    effective_warmup_steps,
    warmup_fraction,
    warn_if_total_below_warmup,
)


def warmup_cosine_ratio_at(
    step: int,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> float:
    """The factor WarmupCosineLR multiplies each group's base lr by at ``step``."""
    if step < 0:
        return 0.0
    n = effective_warmup_steps(warmup_num_steps)
    if step < n:
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * warmup_fraction(step, warmup_num_steps, warmup_type)
    progress = min(1.0, (step - n + 1) / max(1, total_num_steps - n))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0)


_RATIO = partial(check_number, minimum=0.0, maximum=1.0)

WARMUP_COSINE_LR_SPEC: dict[str, ParamSpec] = {
    "total_num_steps": ParamSpec(partial(check_int, minimum=1), REQUIRED),
    "warmup_min_ratio": ParamSpec(_RATIO, 0.0),
    "warmup_num_steps": WARMUP_NUM_STEPS_SPEC,
    "cos_min_ratio": ParamSpec(_RATIO, 0.0001),
    "warmup_type": WARMUP_TYPE_SPEC,
    "last_batch_iteration": LAST_BATCH_ITERATION_SPEC,
}


class WarmupCosineLR(BatchLRScheduler):
    """DeepSpeed's WarmupCosineLR: ratio warmup to 1, then cosine decay to ``cos_min_ratio``, times each
    group's lr at construction (its base lr)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        spec_values = {
            "total_num_steps": total_num_steps,
            "warmup_min_ratio": warmup_min_ratio,
            "warmup_num_steps": warmup_num_steps,
            "cos_min_ratio": cos_min_ratio,
            "warmup_type": warmup_type,
        }
        checked = {key: WARMUP_COSINE_LR_SPEC[key].check(value, key) for key, value in spec_values.items()}
        self.total_num_steps: int = checked["total_num_steps"]
        self.warmup_min_ratio: float = checked["warmup_min_ratio"]
        self.warmup_num_steps: int = checked["warmup_num_steps"]
        self.cos_min_ratio: float = checked["cos_min_ratio"]
        self.warmup_type: str = checked["warmup_type"]
        warn_if_total_below_warmup(self.total_num_steps, self.warmup_num_steps)
        self.base_lrs = group_lrs(optimizer)
        self._start()

    def ratio_at(self, step: int) -> float:
        """The schedule's factor at ``step`` (shared by all groups)."""
        return warmup_cosine_ratio_at(
            step,
            self.total_num_steps,
            self.warmup_min_ratio,
            self.warmup_num_steps,
            self.cos_min_ratio,
            self.warmup_type,
        )

    def lrs_at(self, step: int) -> list[float]:
        ratio = self.ratio_at(step)
        return [base_lr * ratio for base_lr in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        # The base lrs came from the optimizer at construction; without them a resumed run whose optimizer
        # state (current lr) was loaded first would scale the schedule by a mid-schedule lr.
        return {**super().state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "base_lrs" in state_dict:
            self.base_lrs = [float(lr) for lr in state_dict["base_lrs"]]
        super().load_state_dict(state_dict)
