"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters``, ``register_external_parameter`` (from
``shardspeed.zero``) and ``TiledLinear`` (``tiling.py``). Loaded on first use, so ``shardspeed.zero`` can import
``tiling`` without a cycle."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Init": "shardspeed.zero",
    "GatheredParameters": "shardspeed.zero",
    "register_external_parameter": "shardspeed.zero",
    "TiledLinear": "shardspeed.runtime.zero.tiling",
    "TiledLinearReturnBias": "shardspeed.runtime.zero.tiling",
}
_SUBMODULES = ("estimate", "partition_parameters", "stage3", "stage_1_and_2", "tiling")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"shardspeed.runtime.zero.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardspeed.runtime.zero' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)


__all__ = list(_EXPORTS)
