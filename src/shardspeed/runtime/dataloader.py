"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` and the engine's loader (``DeepSpeedDataLoader``)."""

from shardspeed.data import RepeatingLoader, ShardSpeedDataLoader

DeepSpeedDataLoader = ShardSpeedDataLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]
