"""shardspeed: DeepSpeed's training system as a pure-Python library on torch.distributed.

Public names are imported lazily so `shardspeed --help` and the launcher start without importing torch.
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
}

__all__ = [*_EXPORTS, "__version__"]


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
