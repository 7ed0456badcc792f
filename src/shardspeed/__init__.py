"""shardspeed: DeepSpeed's training system as a pure-Python library on torch.distributed.

Public names are imported lazily so `shardspeed --help` and the launcher start without importing torch.

DeepSpeed's top-level names are here too, so ``import shardspeed as deepspeed`` keeps a DeepSpeed script working:
``add_config_arguments``, ``init_distributed`` (DeepSpeed's parameters), ``DeepSpeedEngine``, ``DeepSpeedConfig``,
``get_accelerator``, ``log_dist`` / ``logger``, and the subpackages ``comm``, ``accelerator``, ``ops``,
``runtime``, ``utils``, ``zero``, ``checkpointing``, ``pipe`` (``PipelineModule`` is also top-level,
as in DeepSpeed). ``moe`` raises ImportError: not implemented yet.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "shardspeed.api",
    "init_distributed": "shardspeed.distributed",
    "ShardSpeedEngine": "shardspeed.engine",
    "RepeatingLoader": "shardspeed.data",
    "MeshShape": "shardspeed.topology",
    "Topology": "shardspeed.topology",
    "estimate_zero_memory": "shardspeed.zero.memory",
    # DeepSpeed's top-level names (deepspeed/__init__.py)
    "add_config_arguments": "shardspeed.utils.arguments",
    "DeepSpeedEngine": "shardspeed.runtime.engine",
    "DeepSpeedConfig": "shardspeed.runtime.config",
    "DeepSpeedConfigError": "shardspeed.runtime.config",
    "DeepSpeedDataLoader": "shardspeed.runtime.dataloader",
    "get_accelerator": "shardspeed.accelerator",
    "log_dist": "shardspeed.utils.logging",
    "logger": "shardspeed.utils.logging",
    "PipelineModule": "shardspeed.pipe",
}

version = __version__  # DeepSpeed exposes both

__all__ = [*_EXPORTS, "__version__", "version"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a subpackage such as shardspeed.data or shardspeed.zero
            return importlib.import_module(f"shardspeed.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'shardspeed' has no attribute '{name}'") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
