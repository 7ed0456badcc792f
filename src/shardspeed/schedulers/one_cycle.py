"""DeepSpeed's ``OneCycle`` (Smith 2018, arXiv 1803.09820): one lr cycle up and down, then decay.

Cycle phase, ``step < total = first + second``. DeepSpeed measures the position from ``step + 1``::

    pos   = (step + 1) mod total
    scale = pos / first                          pos <= first   (rising half)
          = (total - pos) / second               otherwise      (falling half)
    with a stair count s > 0 for that half, scale = floor(pos_in_half * s / half_size) / s  (a staircase)
    lr    = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
    mom   = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale   (momentum moves against the lr)

Decay phase, ``step >= total``, with ``k = (step - total + 1) / decay_step_size`` (continuous, not floored)::

    lr  = cycle_min_lr / (1 + decay_lr_rate * k)
    mom = cycle_max_mom * (1 + decay_mom_rate * k)
    (decay_step_size == 0 or a rate of 0 holds the value at cycle_min_lr / cycle_max_mom)

Momentum is Adam-style ``betas[0]``; it is cycled only when every param group has ``betas`` (otherwise we
warn and leave momentum alone, like DeepSpeed). Two deliberate differences from DeepSpeed: we keep each
group's own ``betas[1]`` (DeepSpeed overwrites it with 0.99), and at construction we write the curve's
momentum (``cycle_max_mom``, which goes with ``cycle_min_lr``) where DeepSpeed writes ``cycle_min_mom``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from shardspeed.optim.param_checks import (
    REQUIRED,
    ParamSpec,
    check_bool,
    check_int,
    check_number,
    check_number_or_list,
    optional,
)
from shardspeed.schedulers.base import BatchLRScheduler, per_group
from shardspeed.schedulers.warmup import LAST_BATCH_ITERATION_SPEC

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CycleShape:
    """The step counts of the cycle: its rising and falling halves and their staircase counts (0: smooth)."""

    first_step_size: int
    second_step_size: int
    first_stair_count: int = 0
    second_stair_count: int = 0
    decay_step_size: int = 0

    @property
    def total_size(self) -> int:
        return self.first_step_size + self.second_step_size


def one_cycle_scale_at(step: int, shape: CycleShape) -> float:
    """How far up the cycle (0 = at min lr, 1 = at max lr) index ``step`` is, during the cycle phase."""
    position = (step + 1) % shape.total_size
    if position <= shape.first_step_size:
        offset, size, stairs = position, shape.first_step_size, shape.first_stair_count
    else:
        offset, size, stairs = shape.total_size - position, shape.second_step_size, shape.second_stair_count
    if stairs > 0:
        # Integer floor of offset * stairs / size: exact, so a stair edge never lands one stair low.
        return (offset * stairs // size) / stairs
    return offset / size


def _decay_interval(step: int, shape: CycleShape) -> float:
    return (step - shape.total_size + 1) / shape.decay_step_size


def one_cycle_lr_at(
    step: int, cycle_min_lr: float, cycle_max_lr: float, shape: CycleShape, decay_lr_rate: float = 0.0
) -> float:
    """OneCycle's lr at ``step`` (see the module docstring)."""
    if step < shape.total_size:
        return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * one_cycle_scale_at(step, shape)
    if shape.decay_step_size == 0 or decay_lr_rate == 0.0:
        return cycle_min_lr
    return cycle_min_lr / (1.0 + decay_lr_rate * _decay_interval(step, shape))


def one_cycle_momentum_at(
    step: int, cycle_min_mom: float, cycle_max_mom: float, shape: CycleShape, decay_mom_rate: float = 0.0
) -> float:
    """OneCycle's momentum (``betas[0]``) at ``step``; it moves opposite to the lr."""
    if step < shape.total_size:
        return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * one_cycle_scale_at(step, shape)
    if shape.decay_step_size == 0 or decay_mom_rate == 0.0:
        return cycle_max_mom
    return cycle_max_mom * (1.0 + decay_mom_rate * _decay_interval(step, shape))


_NON_NEGATIVE = partial(check_number, minimum=0.0)
_MOMENTUM = partial(check_number, minimum=0.0, maximum=1.0)
_LR = partial(check_number_or_list, minimum=0.0)

ONE_CYCLE_SPEC: dict[str, ParamSpec] = {
    "cycle_min_lr": ParamSpec(_LR, REQUIRED),
    "cycle_max_lr": ParamSpec(_LR, REQUIRED),
    "decay_lr_rate": ParamSpec(_NON_NEGATIVE, 0.0),
    "cycle_first_step_size": ParamSpec(partial(check_int, minimum=1), 2000),
    "cycle_second_step_size": ParamSpec(optional(partial(check_int, minimum=1)), None),
    "cycle_first_stair_count": ParamSpec(partial(check_int, minimum=0), 0),
    "cycle_second_stair_count": ParamSpec(optional(partial(check_int, minimum=0)), None),
    "decay_step_size": ParamSpec(partial(check_int, minimum=0), 0),
    "cycle_momentum": ParamSpec(check_bool, True),
    "cycle_min_mom": ParamSpec(_MOMENTUM, 0.8),
    "cycle_max_mom": ParamSpec(_MOMENTUM, 0.9),
    "decay_mom_rate": ParamSpec(_NON_NEGATIVE, 0.0),
    "last_batch_iteration": LAST_BATCH_ITERATION_SPEC,
}


class OneCycle(BatchLRScheduler):
    """DeepSpeed's OneCycle schedule for lr and (optionally) Adam-style momentum."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = check_int(cycle_first_step_size, "cycle_first_step_size", minimum=1)
        first_stairs = check_int(cycle_first_stair_count, "cycle_first_stair_count", minimum=0)
        self.shape = CycleShape(
            first_step_size=first,
            second_step_size=first
            if cycle_second_step_size is None
            else check_int(cycle_second_step_size, "cycle_second_step_size", minimum=1),
            first_stair_count=first_stairs,
            second_stair_count=first_stairs
            if cycle_second_stair_count is None
            else check_int(cycle_second_stair_count, "cycle_second_stair_count", minimum=0),
            decay_step_size=check_int(decay_step_size, "decay_step_size", minimum=0),
        )
        num_groups = len(optimizer.param_groups)
        self.min_lrs = per_group(cycle_min_lr, num_groups, "cycle_min_lr")
        self.max_lrs = per_group(cycle_max_lr, num_groups, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.cycle_min_mom = float(cycle_min_mom)
        self.cycle_max_mom = float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not all("betas" in group for group in optimizer.param_groups):
            logger.warning(
                "OneCycle: cycle_momentum is disabled because %s has no 'betas' in its param groups",
                type(optimizer).__name__,
            )
            self.cycle_momentum = False
        self._start()

    def lrs_at(self, step: int) -> list[float]:
        return [
            one_cycle_lr_at(step, low, high, self.shape, self.decay_lr_rate)
            for low, high in zip(self.min_lrs, self.max_lrs)
        ]

    def momentum_at(self, step: int) -> float | None:
        """``betas[0]`` at ``step``, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return one_cycle_momentum_at(step, self.cycle_min_mom, self.cycle_max_mom, self.shape, self.decay_mom_rate)

    def _apply_extras(self, step: int) -> None:
        momentum = self.momentum_at(step)
        if momentum is None:
            return
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            if isinstance(beta1, torch.Tensor):
                beta1.fill_(momentum)
            else:
                group["betas"] = (momentum, beta2)
