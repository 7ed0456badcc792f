"""Hugging Face integration: ``ShardSpeedTrainer`` (the Trainer training through a shardspeed engine) and
``from_config`` / ``zero3_init_context`` (HF models built under ``zero.Init``). Needs ``transformers`` (the ``hf``
extra). See [Note: HF Trainer integration] in ``trainer.py`` for why this is a Trainer subclass and not a module
that poses as ``deepspeed``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardSpeedTrainer": "shardspeed.integrations.hf.trainer",
    "from_config": "shardspeed.integrations.hf.models",
    "zero3_init_context": "shardspeed.integrations.hf.models",
    "fill_auto": "shardspeed.integrations.hf.config",
    "TrainerValues": "shardspeed.integrations.hf.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardspeed.integrations.hf' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
