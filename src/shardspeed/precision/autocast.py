"""``torch_autocast``: the module's forward under ``torch.autocast`` (DeepSpeed's ``autocast_if_enabled``).

DeepSpeed's rules, followed here: the parameters keep the dtype the rest of the config gives them (fp32, or bf16
under ``bf16.enabled``: autocast does not change what is stored, only what each op computes in); the engine's
section wins over an autocast the caller opened around ``engine(x)`` (its dtype is used inside the forward).
Differences: shardspeed leaves a caller's own autocast alone when the section is off (DeepSpeed turns it off inside
the engine), and does not read ``lower_precision_safe_modules`` (refused by the config): every gradient is reduced
in ``communication_data_type``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardspeed.config.precision import TorchAutocastConfig


@contextlib.contextmanager
def forward_autocast(section: TorchAutocastConfig, device: torch.device) -> Iterator[None]:
    """``torch.autocast(device.type, section.dtype)`` when the section is enabled, else nothing."""
    if not section.enabled:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=section.dtype, enabled=True):
        yield


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor inside tuples / lists / dicts cast to ``dtype`` (fp16
    ``auto_cast``: the engine casts the forward's inputs)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj
