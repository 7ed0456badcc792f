"""DeepSpeed's ZeRO-3 leaf-module API (``deepspeed.utils.set_z3_leaf_modules`` and friends).

A leaf module's whole subtree is one ZeRO-3 unit, gathered whole around the leaf's forward, and no hooks are
attached to its children — for modules whose children run data-dependently (mixture-of-experts layers) or that
are too fine-grained to gather piece by piece. See ``shardspeed.zero.stage3.leaves`` and docs/zero3.md.

Flag the modules **before** ``shardspeed.initialize`` (the engine plans its units once); flagging a module
whose parameters a live ZeRO-3 engine already partitions is an error. DeepSpeed marks a flagged module with an
attribute (``module._z3_leaf``) and its parameters with another (``ds_z3_leaf_module``); here the flag lives in
a registry keyed by module identity (``LEAF_FLAGS``), so modules and parameters stay untouched and the flag
disappears with the module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.zero.stage3.leaves import class_matches
from shardspeed.zero.stage3.registry import LEAF_FLAGS, partitioned

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is flagged as a ZeRO-3 leaf."""
    return bool(LEAF_FLAGS.get(module))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a module flagged as a ZeRO-3 leaf (to it or to a module below it)."""
    return any(flag and any(p is param for p in m.parameters()) for m, flag in LEAF_FLAGS.items())


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` flagged as ZeRO-3 leaves, in ``model.modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(module: torch.nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"set_z3_leaf_module: expected an nn.Module, got {type(module).__name__}")
    _check_not_partitioned(module)
    if flag:
        LEAF_FLAGS.set(module, True)
    else:
        LEAF_FLAGS.pop(module)


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or class
    names: bare or fully qualified) as a ZeRO-3 leaf; returns them. Call before ``shardspeed.initialize``."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Undo ``set_z3_leaf_modules`` for those classes; returns the modules unflagged."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules named (paths as in ``model.named_modules()``); returns (modules, names not found)."""
    modules = dict(model.named_modules())
    found = [modules[n] for n in module_names if n in modules]
    missing = [n for n in module_names if n not in modules]
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in {type(model).__name__}")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found, missing


def _set_by_class(
    model: torch.nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[torch.nn.Module]:
    if isinstance(classes, (str, type)) or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(
            f"leaf_module_classes must be a list of classes or class names, got {classes!r} "
            "(e.g. [MixtralSparseMoeBlock] or ['MixtralSparseMoeBlock'])"
        )
    matched = [m for m in model.modules() if any(class_matches(m, c) for c in classes)]
    if not matched and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of class {names} in {type(model).__name__}")
    for m in matched:
        set_z3_leaf_module(m, flag)
    return matched


def _check_not_partitioned(module: torch.nn.Module) -> None:
    for p in module.parameters():
        if partitioned(p) is not None:
            raise RuntimeError(
                f"set_z3_leaf_modules on {type(module).__name__} after shardspeed.initialize(): the ZeRO-3 engine "
                "plans its units once, at initialize(). Flag leaf modules before initialize (or use the config's "
                "zero_optimization.leaf_module)"
            )
