"""Writes to partitioned parameters outside a gathered block are an error at the next forward, never silent.

[Note: placeholder writes] Between uses a ZeRO-3 parameter is an empty placeholder (``numel() == 0``) and its
values live in its unit's shard. Code that writes the parameter in place then — typically
``engine.module.apply(init_fn)`` after ``initialize``, with ``torch.nn.init.normal_(m.weight)`` — writes nothing,
and training would silently continue from the old values. DeepSpeed's answer (``override_module_apply: true``)
replaces ``nn.Module.apply`` on the model's modules so each call gathers the module's parameters around ``fn``;
shardspeed does not patch modules or torch, so it offers the same operation as a function
(``shardspeed.zero.apply(module, fn)``, zero/api.py) and turns the silent case into an error:

every in-place op on a tensor bumps its version counter (``p._version``; a parameter keeps its counter when the
engine swaps its ``.data`` between shard and gathered buffer). This guard records every parameter's version when
the engine sets it up, after each forward (a module may edit its own gathered weights there) and when a
``GatheredParameters`` block exits (edits made on whole parameters, kept or deliberately dropped). A version that
moved anywhere else moved while the parameter was a placeholder (or, for a persistent small parameter, while its
shard was not told): the next forward raises, naming the parameter and what to do instead.

Limit: writes through ``p.data`` (``m.weight.data.normal_()``) go to a fresh tensor with its own counter and cannot
be seen; docs/zero3.md says so. The check runs on every rank with no collective: ranks that all ran the same
``apply`` all raise; a write on one rank only raises there (the others then wait in their first gather until the
process-group timeout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardspeed.zero.stage3.unit import ParamUnit


class PlaceholderWriteError(RuntimeError):
    """A partitioned ZeRO-3 parameter was written in place outside a gathered block (the write was lost)."""


class PlaceholderWriteGuard:
    def __init__(self, units: Sequence[ParamUnit], module: torch.nn.Module) -> None:
        self.units = list(units)
        self._versions: list[list[int]] = [[p._version for p in u.params] for u in self.units]
        eager = torch.compiler.disable  # [Note: hooks run eagerly under torch.compile] in runtime.py
        self._handles = [
            module.register_forward_pre_hook(eager(self._check)),
            module.register_forward_hook(eager(self._after_forward)),
        ]

    def accept(self, unit: ParamUnit) -> None:
        """``unit``'s parameters were written while whole (``GatheredParameters``): their versions are current."""
        self._versions[unit.index] = [p._version for p in unit.params]

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for unit in self.units:
            self.accept(unit)

    def _check(self, module: torch.nn.Module, args: Any) -> None:
        written = [
            f"'{name}' (unit '{unit.name}')"
            for unit, versions in zip(self.units, self._versions)
            for p, name, seen in zip(unit.params, unit.names, versions)
            if p._version != seen
        ]
        if not written:
            return
        for unit in self.units:
            self.accept(unit)  # raise once, not again at every later forward
        more = f" and {len(written) - 3} more" if len(written) > 3 else ""
        raise PlaceholderWriteError(
            f"ZeRO-3 parameters {', '.join(written[:3])}{more} were modified in place outside a gathered block "
            "since the last forward (e.g. engine.module.apply(init_fn) or torch.nn.init on them after "
            "shardspeed.initialize). Under ZeRO-3 a parameter is an empty placeholder between uses (small persistent "
            "ones are copies the optimizer step overwrites), so the write was lost. Use "
            "shardspeed.zero.apply(engine.module, init_fn) (gathers each module's parameters around init_fn and keeps "
            "rank 0's result), or edit inside shardspeed.zero.GatheredParameters(params, modifier_rank=0). Set "
            "zero_optimization.override_module_apply to false to skip this check."
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
