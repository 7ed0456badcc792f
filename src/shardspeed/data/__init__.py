"""Training data: world-size-independent sampling, prefetching loader, and ``RepeatingLoader``."""

from __future__ import annotations

from shardspeed.data.loader import ShardSpeedDataLoader, build_dataloader
from shardspeed.data.prefetch import PrefetchIterator, move_to_device
from shardspeed.data.repeating import RepeatingLoader
from shardspeed.data.sampler import GlobalIndexSampler

__all__ = [
    "GlobalIndexSampler",
    "PrefetchIterator",
    "RepeatingLoader",
    "ShardSpeedDataLoader",
    "build_dataloader",
    "move_to_device",
]
