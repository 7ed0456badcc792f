"""``deepspeed.runtime.lr_schedules``: DeepSpeed's LR schedule classes and their config names."""

from shardspeed.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = [
    "LR_RANGE_TEST",
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LR",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
