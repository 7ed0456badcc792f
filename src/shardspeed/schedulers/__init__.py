"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest).

Each curve is a pure function of the step index (``warmup_lr_at``, ``warmup_decay_lr_at``,
``warmup_cosine_ratio_at``, ``one_cycle_lr_at``/``one_cycle_momentum_at``, ``lr_range_test_lr_at``); the
classes apply it to every param group. Index convention: see ``shardspeed.schedulers.base``.
"""

from __future__ import annotations

from shardspeed.schedulers.base import BatchLRScheduler
from shardspeed.schedulers.build import (
    SCHEDULERS,
    build_scheduler,
    canonical_scheduler_name,
    validate_scheduler_params,
)
from shardspeed.schedulers.cosine import WarmupCosineLR, warmup_cosine_ratio_at
from shardspeed.schedulers.one_cycle import (
    CycleShape,
    OneCycle,
    one_cycle_lr_at,
    one_cycle_momentum_at,
    one_cycle_scale_at,
)
from shardspeed.schedulers.range_test import LRRangeTest, lr_range_test_lr_at
from shardspeed.schedulers.warmup import WarmupDecayLR, WarmupLR, warmup_decay_lr_at, warmup_lr_at

__all__ = [
    "SCHEDULERS",
    "BatchLRScheduler",
    "CycleShape",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "canonical_scheduler_name",
    "lr_range_test_lr_at",
    "one_cycle_lr_at",
    "one_cycle_momentum_at",
    "one_cycle_scale_at",
    "validate_scheduler_params",
    "warmup_cosine_ratio_at",
    "warmup_decay_lr_at",
    "warmup_lr_at",
]
