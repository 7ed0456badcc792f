"""Process-wide weak lookups from tensors and modules to what ZeRO-3 knows about them.

Why this exists: ``zero.full_shape(p)``, ``zero.GatheredParameters(p)`` and ``zero.register_external_parameter``
are handed a bare ``nn.Parameter`` (or module) and must find its unit, its full shape, the engine's fp32 master
shard, or the zero.Init context it was created in. DeepSpeed answers that with attributes on the parameter
(``p.ds_shape``, ``p.ds_status``…); shardspeed's design forbids attributes on ``nn.Parameter``, so the answer lives
here instead, keyed by object identity.

Why not ``weakref.WeakKeyDictionary``: it compares keys with ``==``, which for tensors is elementwise and cannot be
turned into a bool. ``WeakIdMap`` keys by ``id(obj)``, keeps a weak reference to check the entry still belongs to the
same live object, and drops the entry from a ``weakref.finalize`` callback when the object dies — so the registry
never keeps a parameter, unit or module alive and a recycled ``id`` never finds a stale entry.

This is not distributed state: nothing here names a process group or a rank. Entries hold weak references to the
units and states they describe, so dropping an engine frees its buffers even while the model lives on.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from shardspeed.zero.stage3.plan import UnitPlan, _enclosing_root, hook_path

if TYPE_CHECKING:
    from shardspeed.zero.stage3.unit import ParamUnit

V = TypeVar("V")


class WeakIdMap(Generic[V]):
    """A mapping object → value keyed by identity that never keeps its keys alive."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], V]] = {}

    def set(self, obj: object, value: V) -> None:
        key = id(obj)
        previous = self._entries.get(key)
        if previous is None or previous[0]() is not obj:
            weakref.finalize(obj, self._drop, key, weakref.ref(obj))
        self._entries[key] = (weakref.ref(obj), value)

    def get(self, obj: object) -> V | None:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def pop(self, obj: object) -> V | None:
        value = self.get(obj)
        if value is not None:
            del self._entries[id(obj)]
        return value

    def __contains__(self, obj: object) -> bool:
        return self.get(obj) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> Iterator[tuple[Any, V]]:
        for ref, value in list(self._entries.values()):
            obj = ref()
            if obj is not None:
                yield obj, value

    def _drop(self, key: int, ref: weakref.ref[Any]) -> None:
        entry = self._entries.get(key)
        # Only drop the entry of the object that died, never a newer one that reused its id.
        if entry is not None and entry[0]() is None:
            del self._entries[key]


@dataclass(frozen=True)
class PartitionedParam:
    """Where a ZeRO-3 parameter lives: its unit, its position in the unit, and the model states that own it."""

    unit_ref: weakref.ref[ParamUnit]
    index: int
    states_ref: weakref.ref[Any]  # Stage3States (fp32 master shards under mixed precision)

    @property
    def unit(self) -> ParamUnit | None:
        return self.unit_ref()

    @property
    def full_shape(self) -> torch.Size:
        unit = self.unit_ref()
        assert unit is not None, "the ZeRO-3 unit of this parameter was freed while the parameter lives"
        return unit.shapes[self.index]


PARTITIONED: WeakIdMap[PartitionedParam] = WeakIdMap()
"""nn.Parameter → its ZeRO-3 unit. Filled by ``Stage3States`` once its units are built."""

EXTERNAL: WeakIdMap[list[weakref.ref[torch.nn.Parameter]]] = WeakIdMap()
"""nn.Module → parameters owned elsewhere that its forward uses (``zero.register_external_parameter``)."""

LEAF_FLAGS: WeakIdMap[bool] = WeakIdMap()
"""nn.Module → True when flagged a ZeRO-3 leaf by ``shardspeed.utils.set_z3_leaf_modules`` (DeepSpeed sets
``module._z3_leaf``; keyed by identity here, nothing is written on the module). Read by stage3/leaves.py."""


def register_units(states: Any) -> None:
    """Record every parameter of ``states.units`` (a ``Stage3States``) in ``PARTITIONED``."""
    states_ref = weakref.ref(states)
    for unit in states.units:
        unit_ref = weakref.ref(unit)
        for index, param in enumerate(unit.params):
            PARTITIONED.set(param, PartitionedParam(unit_ref, index, states_ref))


def partitioned(param: torch.Tensor) -> PartitionedParam | None:
    """The ZeRO-3 record of ``param``, or None for a parameter no live stage-3 engine partitions."""
    record = PARTITIONED.get(param)
    if record is None or record.unit is None:
        return None
    return record


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters registered as external for ``module`` that are still alive."""
    refs = EXTERNAL.get(module) or []
    return [p for p in (r() for r in refs) if p is not None]


def add_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    refs = EXTERNAL.get(module)
    if refs is None:
        refs = []
        EXTERNAL.set(module, refs)
    if not any(r() is param for r in refs):
        refs.append(weakref.ref(param))


def merge_external_parameters(module: torch.nn.Module, plan: UnitPlan) -> None:
    """Add the unit of every external parameter registered on a module of ``module`` to ``plan.foreign``, so the
    runtime gathers it around that module's forward (and backward) like a tied weight's unit."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    for path, m in module.named_modules(remove_duplicate=False):
        for param in external_parameters(m):
            name = canonical.get(id(param))
            if name is None:
                raise ValueError(
                    f"zero.register_external_parameter: module '{path or '<root>'}' ({type(m).__name__}) registered "
                    f"a parameter of shape {tuple(param.shape)} that is not a parameter of the model passed to "
                    "initialize(); register a parameter the model owns (e.g. other_module.weight)"
                )
            unit = plan.owner[name]
            if unit == plan.persistent or unit == _enclosing_root(path, plan.roots):
                continue  # whole anyway, or gathered around this module already
            needed = plan.foreign.setdefault(hook_path(path, plan.units, plan.roots), [])
            if unit not in needed:
                needed.append(unit)
