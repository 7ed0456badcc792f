"""Which parameters form which communication unit under ZeRO-3 — a pure function of the module tree.

A *unit* is the set of parameters gathered with one all-gather. Default granularity (see `plan_units`):
- every child of an ``nn.ModuleList`` / ``nn.Sequential`` that holds parameters is one unit (a transformer
  block, a layer of a stack) — its whole subtree;
- every other module that directly owns parameters and is not inside such a child is a unit of its own
  direct parameters (embeddings, final norm, head);
- every *leaf* module (``leaves``: see leaves.py) not inside such a unit is one unit — its whole subtree, rooted
  at the leaf, whose children get no hooks; a leaf inside a container child is whole anyway;
- parameters with at most ``persistence_threshold`` elements are *persistent*: kept whole on every rank in
  one extra unit that is never released (DeepSpeed's ``stage3_param_persistence_threshold``), which saves
  many tiny collectives for biases and norms; ``stage3_model_persistence_threshold`` caps their total.
A parameter shared by several modules (tied embedding and head) belongs to the first unit that owns it; other
modules that use it list that unit in their ``needs`` so it is gathered around their forward too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

PERSISTENT = "<persistent>"


@dataclass
class UnitSpec:
    name: str  # module path of the unit root, or PERSISTENT
    param_names: list[str] = field(default_factory=list)
    data_dependent: bool = False
    """The unit's subtree holds a leaf module, whose children may run on some ranks and not others (experts):
    which of its parameters get gradients differs between ranks, so its reduction cannot be launched when
    "all its gradients arrived" (ranks would launch it at different points) but after backward, in unit order."""


@dataclass
class UnitPlan:
    units: list[UnitSpec]
    roots: dict[str, int]  # unit-root module path → unit index (the persistent unit has no root)
    foreign: dict[str, list[int]]  # module path → units (other than its own) whose parameters it uses directly
    owner: dict[str, int]  # canonical parameter name → unit index

    @property
    def persistent(self) -> int | None:
        return next((i for i, u in enumerate(self.units) if u.name == PERSISTENT), None)


def _container_children(
    module: torch.nn.Module, prefix: str, leaves: frozenset[str] = frozenset()
) -> list[tuple[str, torch.nn.Module]]:
    """Children of ModuleList/Sequential containers and leaf modules, outermost first (a unit never nests inside
    a unit)."""
    found: list[tuple[str, torch.nn.Module]] = []
    if prefix in leaves:
        return [(prefix, module)]

    def walk(m: torch.nn.Module, path: str) -> None:
        is_container = isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
        for name, child in m.named_children():
            child_path = f"{path}.{name}" if path else name
            if (is_container or child_path in leaves) and any(True for _ in child.parameters()):
                found.append((child_path, child))
            else:
                walk(child, child_path)

    walk(module, prefix)
    return found


def plan_units(
    module: torch.nn.Module,
    persistence_threshold: int = 0,
    leaves: Iterable[str] = (),
    model_cap: int | None = None,
) -> UnitPlan:
    """Assign every parameter of ``module`` (shared ones once, by their first name) to a unit. ``leaves``: module
    paths whose subtree is one unit (leaves.py); a unit root at or above a leaf is ``data_dependent``.
    ``model_cap``: at most this many elements in the persistent unit (``model_persistence_threshold``)."""
    leaf_set = frozenset(leaves)
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters():  # de-duplicated: first name wins
        canonical[id(p)] = name
    units: list[UnitSpec] = []
    roots: dict[str, int] = {}
    owner: dict[str, int] = {}

    persistent_index: int | None = None
    if persistence_threshold > 0:
        small, total = [], 0
        for n, p in module.named_parameters():
            # model_persistence_threshold caps the persistent unit's total (DeepSpeed's rule: in registration order,
            # a small parameter stays whole only while the running total fits)
            if p.numel() <= persistence_threshold and (model_cap is None or total + p.numel() <= model_cap):
                small.append(n)
                total += p.numel()
        if small:
            persistent_index = len(units)
            units.append(UnitSpec(PERSISTENT, small))
            owner.update({n: persistent_index for n in small})

    block_paths = {path for path, _ in _container_children(module, "", leaf_set)}

    def claim(root_path: str, sub: torch.nn.Module, recurse: bool) -> None:
        params = sub.named_parameters(prefix=root_path, recurse=recurse, remove_duplicate=False)
        mine = []
        for _, p in params:
            name = canonical[id(p)]
            if name not in owner and name not in mine:
                mine.append(name)
        if mine:
            roots[root_path] = len(units)
            owner.update({n: len(units) for n in mine})
            holds_leaf = recurse and any(_within(leaf, root_path) for leaf in leaf_set)
            units.append(UnitSpec(root_path, mine, data_dependent=holds_leaf))

    def walk(m: torch.nn.Module, path: str) -> None:
        if path in block_paths:
            claim(path, m, recurse=True)
            return
        claim(path, m, recurse=False)
        for name, child in m.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(module, "")

    # Modules that use parameters owned by another unit (tied weights) gather that unit around their forward.
    foreign: dict[str, list[int]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        enclosing = _enclosing_root(path, roots)
        needed = []
        for p in m._parameters.values():
            if p is None:
                continue
            unit = owner[canonical[id(p)]]
            if unit != enclosing and unit != persistent_index and unit not in needed:
                needed.append(unit)
        if needed:
            hooked = foreign.setdefault(hook_path(path, units, roots), [])
            hooked.extend(u for u in needed if u not in hooked)
    return UnitPlan(units, roots, foreign, owner)


def hook_path(path: str, units: list[UnitSpec], roots: dict[str, int]) -> str:
    """Where a module's extra gathers (tied or external parameters) hook: the module itself, unless it sits inside a
    leaf's unit — its children may not run on every rank, so the gather goes around the whole leaf instead."""
    enclosing = _enclosing_root(path, roots)
    if enclosing is not None and units[enclosing].data_dependent:
        return units[enclosing].name
    return path


def _within(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(f"{root}.")


def _enclosing_root(path: str, roots: dict[str, int]) -> int | None:
    """The unit whose root is ``path`` or its nearest ancestor."""
    parts = path.split(".") if path else []
    for cut in range(len(parts), -1, -1):
        candidate = ".".join(parts[:cut])
        if candidate in roots:
            return roots[candidate]
    return None
