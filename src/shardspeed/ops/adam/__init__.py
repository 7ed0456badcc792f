"""``deepspeed.ops.adam``: FusedAdam and DeepSpeedCPUAdam."""

from shardspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from shardspeed.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
