"""DeepSpeed's ``LRRangeTest`` (Smith 2018): grow the lr steadily to find where training diverges.

With ``step`` the scheduler index (-1 at construction)::

    interval = (step + 1) / lr_range_test_step_size          (floored when lr_range_test_staircase)
    lr       = lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)

So the lr grows linearly (not geometrically) from ``lr_range_test_min_lr``, by ``step_rate`` times the
minimum every ``step_size`` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from shardspeed.optim.param_checks import ParamSpec, check_bool, check_int, check_number, check_number_or_list
from shardspeed.schedulers.base import BatchLRScheduler, per_group
from shardspeed.schedulers.warmup import LAST_BATCH_ITERATION_SPEC


def lr_range_test_lr_at(
    step: int,
    lr_range_test_min_lr: float = 0.001,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
) -> float:
    """LRRangeTest's lr at ``step``."""
    if lr_range_test_staircase:
        interval: float = (step + 1) // lr_range_test_step_size
    else:
        interval = (step + 1) / lr_range_test_step_size
    return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)


LR_RANGE_TEST_SPEC: dict[str, ParamSpec] = {
    "lr_range_test_min_lr": ParamSpec(partial(check_number_or_list, minimum=0.0), 0.001),
    "lr_range_test_step_size": ParamSpec(partial(check_int, minimum=1), 2000),
    "lr_range_test_step_rate": ParamSpec(partial(check_number, minimum=0.0), 1.0),
    "lr_range_test_staircase": ParamSpec(check_bool, False),
    "last_batch_iteration": LAST_BATCH_ITERATION_SPEC,
}


class LRRangeTest(BatchLRScheduler):
    """DeepSpeed's LR range test: linear lr growth from ``lr_range_test_min_lr``, smooth or stepped."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 0.001,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group(lr_range_test_min_lr, len(optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size = check_int(lr_range_test_step_size, "lr_range_test_step_size", minimum=1)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._start()

    def lrs_at(self, step: int) -> list[float]:
        return [
            lr_range_test_lr_at(step, min_lr, self.step_size, self.step_rate, self.staircase) for min_lr in self.min_lrs
        ]
