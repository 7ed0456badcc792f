"""Utilities with DeepSpeed's names (``deepspeed.utils``): the fp32 state-dict helpers of ``zero_to_fp32``,
``logger`` / ``log_dist``, ``RepeatingLoader``, ``set_random_seed`` and the ZeRO-3 leaf-module flags
(``set_z3_leaf_modules``…), and the parameter accessors ``safe_get_full_fp32_param`` / ``safe_set_*``…
(utils/safe_access.py).

Imported lazily, so ``import shardspeed.utils`` does not load torch until one of them is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "get_fp32_state_dict_from_zero_checkpoint": "shardspeed.checkpoint.consolidate",
    "load_state_dict_from_zero_checkpoint": "shardspeed.checkpoint.consolidate",
    "convert_zero_checkpoint_to_fp32_state_dict": "shardspeed.checkpoint.consolidate",
    **{
        name: "shardspeed.utils.z3_leaf_module"
        for name in (
            "get_z3_leaf_modules",
            "set_z3_leaf_module",
            "set_z3_leaf_modules",
            "set_z3_leaf_modules_by_name",
            "unset_z3_leaf_modules",
            "z3_leaf_module",
            "z3_leaf_parameter",
        )
    },
    "logger": "shardspeed.utils.logging",
    "log_dist": "shardspeed.utils.logging",
    "RepeatingLoader": "shardspeed.data",
    "set_random_seed": "shardspeed.runtime.utils",
    **{
        f"safe_{verb}_{scope}_{what}": "shardspeed.utils.safe_access"
        for verb in ("get", "set")
        for scope in ("full", "local")
        for what in ("fp32_param", "grad", "optimizer_state")
    },
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a submodule such as shardspeed.utils.zero_to_fp32
            return importlib.import_module(f"shardspeed.utils.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'shardspeed.utils' has no attribute '{name}'") from None
    loaded = importlib.import_module(module)
    # Bind every export of that module now: importing ``shardspeed.utils.z3_leaf_module`` sets the package attribute
    # ``z3_leaf_module`` to the submodule, which must not shadow the function of the same name (DeepSpeed's too).
    for export, home in _EXPORTS.items():
        if home == module:
            globals()[export] = getattr(loaded, export)
    return globals()[name]
