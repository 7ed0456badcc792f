"""Which modules are ZeRO-3 *leaves*: modules whose whole subtree is one unit, gathered whole around the leaf's
forward (DeepSpeed's ``set_z3_leaf_modules`` / ``leaf_module`` / ``stage3_module_granularity_threshold``).

Why leaves exist: ZeRO-3 gathers a unit around its root module's forward, on every rank, in lock-step (the
unit-id check of every gather turns disagreement into ``UnitMismatchError``). A module whose children run
data-dependently — a mixture-of-experts layer whose router sends this rank's tokens to experts 0 and 2 and the
other rank's to 1 and 3 — would make ranks gather different units at the same point. Made a leaf, the layer is
one unit gathered before the router runs, so every rank performs the same collectives whatever the routing;
its children have no hooks at all. Its gradients are reduced after backward (see ``plan.UnitSpec.data_dependent``)
because which of its parameters get gradients differs between ranks too.

Three sources, combined (a module is a leaf if any source says so):
- modules flagged with ``shardspeed.utils.set_z3_leaf_modules`` (``LEAF_FLAGS`` in registry.py: keyed by module
  identity, no attribute is written on the module);
- the config's ``zero_optimization.leaf_module``: ``classes`` (class name or fully qualified name), ``names``
  (paths as in ``named_modules()``), ``name_suffixes`` (paths ending with ``.suffix`` or equal to it);
- ``module_granularity_threshold`` (``granularity_leaves``): DeepSpeed's rule, parents first.
Everything here is a pure function of the module tree (and the flags), so every rank computes the same leaves.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import torch

from shardspeed.zero.stage3.registry import LEAF_FLAGS

_MAX_LEAF_NUMEL = 1_000_000_000  # DeepSpeed's Z3_MAX_LEAF_SIZE: a huge leaf would be gathered whole at once
_CONTAINERS = (
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.Sequential,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


def qualified_class_name(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def class_matches(module: torch.nn.Module, spec: type | str) -> bool:
    """``spec`` is a class (isinstance) or a name: the bare class name or the fully qualified one."""
    if isinstance(spec, type):
        return isinstance(module, spec)
    return type(module).__name__ == spec or qualified_class_name(module) == spec


def granularity(module: torch.nn.Module) -> dict[str, int]:
    """DeepSpeed's granularity of every module (path → parameter elements per layer of its subtree).

    A torch leaf with parameters counts as one layer; a non-container module adds one layer for itself.
    Containers (ModuleList, Sequential…) and modules without parameters get ``sys.maxsize`` (never leaves:
    a container's own forward may never run), as does any subtree over ``_MAX_LEAF_NUMEL`` elements.
    """
    out: dict[str, int] = {}

    def walk(m: torch.nn.Module, path: str) -> tuple[int, int]:
        if not any(True for _ in m.parameters()):
            out[path] = sys.maxsize
            return 0, 0
        numel = sum(p.numel() for p in m.parameters(recurse=False))
        children = list(m.named_children())
        if not children:
            out[path] = sys.maxsize  # already a leaf of the module tree
            return 1, numel
        layers = 0
        for name, child in children:
            child_layers, child_numel = walk(child, f"{path}.{name}" if path else name)
            layers, numel = layers + child_layers, numel + child_numel
        if isinstance(m, _CONTAINERS):
            out[path] = sys.maxsize
            return layers, numel
        layers += 1
        out[path] = numel // layers if numel <= _MAX_LEAF_NUMEL else sys.maxsize
        return layers, numel

    walk(module, "")
    return out


def granularity_leaves(module: torch.nn.Module, threshold: int) -> list[str]:
    """Module paths made leaves by ``module_granularity_threshold``: walking from the root, the first module
    of each branch whose granularity is at most ``threshold`` (parents before children). 0 = off."""
    if threshold <= 0:
        return []
    values = granularity(module)
    found: list[str] = []

    def walk(m: torch.nn.Module, path: str) -> None:
        if not any(True for _ in m.parameters()):
            return
        if values[path] <= threshold:
            found.append(path)
            return
        for name, child in m.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(module, "")
    return found


def leaf_paths(
    module: torch.nn.Module,
    *,
    classes: Sequence[type | str] = (),
    names: Iterable[str] = (),
    name_suffixes: Iterable[str] = (),
    granularity_threshold: int = 0,
) -> list[str]:
    """Every module path that is a leaf by any source, in ``named_modules()`` order. A module reachable under
    several paths (shared) is named by its first. Unknown ``names`` are an error naming them."""
    modules = dict(module.named_modules())
    wanted_names = list(names)
    missing = [n for n in wanted_names if n not in modules]
    if missing:
        raise ValueError(
            f"zero_optimization.leaf_module.names: no module named {missing} in the model "
            f"({type(module).__name__}); names are paths as in model.named_modules(), e.g. 'layers.0.moe'"
        )
    suffixes = list(name_suffixes)
    chosen = set(wanted_names) | set(granularity_leaves(module, granularity_threshold))
    for path, m in modules.items():
        by_suffix = bool(path) and any(path == s or path.endswith(f".{s}") for s in suffixes)
        if by_suffix or LEAF_FLAGS.get(m) or any(class_matches(m, c) for c in classes):
            chosen.add(path)
    return [path for path in modules if path in chosen]
