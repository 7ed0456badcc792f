"""Groundwork for ZeRO-Offload / ZeRO-Infinity: an asynchronous NVMe tensor swapper and a chunked CPU Adam.

Self-contained pieces; wiring them into the ZeRO stages (``offload_optimizer`` / ``offload_param``) is separate.
"""

from __future__ import annotations

from .aio_config import AioSettings
from .cpu_adam import cpu_adamw_step
from .stream import stream_step
from .swapper import SwapHandle, SwapSetupError, TensorSwapper, aligned_empty, probe_o_direct

__all__ = [
    "AioSettings",
    "SwapHandle",
    "SwapSetupError",
    "TensorSwapper",
    "aligned_empty",
    "cpu_adamw_step",
    "probe_o_direct",
    "stream_step",
]
