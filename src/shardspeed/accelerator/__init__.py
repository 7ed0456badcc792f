"""DeepSpeed's ``deepspeed.accelerator``: ``get_accelerator()`` answers device questions the same way on CUDA and
on CPU, so a script written against it (``get_accelerator().device_name(local_rank)``) runs on both."""

from shardspeed.accelerator.device import (
    Accelerator,
    DeepSpeedAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "Accelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
