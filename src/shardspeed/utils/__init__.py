"""Utilities with DeepSpeed's names (``deepspeed.utils``): the fp32 state-dict helpers of ``zero_to_fp32``,
``logger`` / ``log_dist``, ``RepeatingLoader`` and ``set_random_seed``.

Imported lazily, so ``import shardspeed.utils`` does not load torch until one of them is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "get_fp32_state_dict_from_zero_checkpoint": "shardspeed.checkpoint.consolidate",
    "load_state_dict_from_zero_checkpoint": "shardspeed.checkpoint.consolidate",
    "convert_zero_checkpoint_to_fp32_state_dict": "shardspeed.checkpoint.consolidate",
    "logger": "shardspeed.utils.logging",
    "log_dist": "shardspeed.utils.logging",
    "RepeatingLoader": "shardspeed.data",
    "set_random_seed": "shardspeed.runtime.utils",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a submodule such as shardspeed.utils.zero_to_fp32
            return importlib.import_module(f"shardspeed.utils.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'shardspeed.utils' has no attribute '{name}'") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
