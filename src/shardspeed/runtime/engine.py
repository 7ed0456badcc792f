"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is ``ShardSpeedEngine`` (same object, for isinstance)."""

from shardspeed.engine import ShardSpeedEngine

DeepSpeedEngine = ShardSpeedEngine

__all__ = ["DeepSpeedEngine", "ShardSpeedEngine"]
