"""Which parameters form which communication unit under ZeRO-3 — a pure function of the module tree.

A *unit* is the set of parameters gathered with one all-gather. Default granularity (see `plan_units`):
- every child of an ``nn.ModuleList`` / ``nn.Sequential`` that holds parameters is one unit (a transformer
  block, a layer of a stack) — its whole subtree;
- every other module that directly owns parameters and is not inside such a child is a unit of its own
  direct parameters (embeddings, final norm, head);
- parameters with at most ``persistence_threshold`` elements are *persistent*: kept whole on every rank in
  one extra unit that is never released (DeepSpeed's ``stage3_param_persistence_threshold``), which saves
  many tiny collectives for biases and norms.
A parameter shared by several modules (tied embedding and head) belongs to the first unit that owns it; other
modules that use it list that unit in their ``needs`` so it is gathered around their forward too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PERSISTENT = "<persistent>"


@dataclass
class UnitSpec:
    name: str  # module path of the unit root, or PERSISTENT
    param_names: list[str] = field(default_factory=list)


@dataclass
class UnitPlan:
    units: list[UnitSpec]
    roots: dict[str, int]  # unit-root module path → unit index (the persistent unit has no root)
    foreign: dict[str, list[int]]  # module path → units (other than its own) whose parameters it uses directly
    owner: dict[str, int]  # canonical parameter name → unit index

    @property
    def persistent(self) -> int | None:
        return next((i for i, u in enumerate(self.units) if u.name == PERSISTENT), None)


def _container_children(module: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Module]]:
    """Children of ModuleList/Sequential containers, outermost first (a unit never nests inside a unit)."""
    found: list[tuple[str, torch.nn.Module]] = []

    def walk(m: torch.nn.Module, path: str) -> None:
        is_container = isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
        for name, child in m.named_children():
            child_path = f"{path}.{name}" if path else name
            if is_container and any(True for _ in child.parameters()):
                found.append((child_path, child))
            else:
                walk(child, child_path)

    walk(module, prefix)
    return found


def plan_units(module: torch.nn.Module, persistence_threshold: int = 0) -> UnitPlan:
    """Assign every parameter of ``module`` (shared ones once, by their first name) to a unit."""
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters():  # de-duplicated: first name wins
        canonical[id(p)] = name
    units: list[UnitSpec] = []
    roots: dict[str, int] = {}
    owner: dict[str, int] = {}

    persistent_index: int | None = None
    if persistence_threshold > 0:
        small = [n for n, p in module.named_parameters() if p.numel() <= persistence_threshold]
        if small:
            persistent_index = len(units)
            units.append(UnitSpec(PERSISTENT, small))
            owner.update({n: persistent_index for n in small})

    block_paths = {path for path, _ in _container_children(module, "")}

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
            units.append(UnitSpec(root_path, mine))

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
            foreign[path] = needed
    return UnitPlan(units, roots, foreign, owner)


def _enclosing_root(path: str, roots: dict[str, int]) -> int | None:
    """The unit whose root is ``path`` or its nearest ancestor."""
    parts = path.split(".") if path else []
    for cut in range(len(parts), -1, -1):
        candidate = ".".join(parts[:cut])
        if candidate in roots:
            return roots[candidate]
    return None
