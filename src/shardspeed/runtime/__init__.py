"""DeepSpeed's ``deepspeed.runtime.*`` import paths, as thin re-exports of shardspeed's modules.

``from deepspeed.runtime.utils import see_memory_usage``, ``deepspeed.runtime.lr_schedules.WarmupLR``,
``deepspeed.runtime.engine.DeepSpeedEngine``, ``deepspeed.runtime.dataloader.RepeatingLoader``,
``deepspeed.runtime.config.DeepSpeedConfig``, ``deepspeed.runtime.zero.tiling.TiledLinear`` ... work with
``shardspeed`` in place of ``deepspeed``. Submodules load on first use (``shardspeed.runtime.utils`` as an
attribute works too, as ``deepspeed.runtime.utils.set_random_seed`` is written in DeepSpeed's examples).
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("activation_checkpointing", "config", "dataloader", "engine", "lr_schedules", "pipe", "utils", "zero")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"shardspeed.runtime.{name}")
    raise AttributeError(f"module 'shardspeed.runtime' has no attribute '{name}'")
