"""``zero.GatheredParameters``: ZeRO-3 parameters whole inside a ``with`` block, optionally edited on one rank.

Entering gathers the units holding the given parameters (a collective: every data-parallel rank must enter with
the same parameters — the units are gathered in unit order, so the order of ``params`` does not matter, and the
unit-id check of every gather turns a mismatch into an error instead of swapped weights). Exiting with
``modifier_rank=r`` broadcasts each unit's whole buffer from data-parallel rank ``r`` and writes it back into the
shards — and into the fp32 master shards under mixed precision, or the next optimizer step would copy the old
masters back over the edit. Units this context gathered are then released; units that were already whole (the
persistent small parameters, or a unit in use) stay as they were.

Parameters that no stage-3 engine partitions (other stages, or a model not yet passed to ``initialize``) are left
alone: for them the context is a no-op, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.zero.stage3.registry import PartitionedParam, partitioned
from shardspeed.zero.stage3.unit import ParamUnit, UnitState


class GatheredParameters:
    """Context manager: ``params`` (one parameter or an iterable) are whole inside the block.

    ``modifier_rank``: the data-parallel rank whose in-place edits (``p.copy_(...)`` / ``p.data.normal_()`` under
    ``torch.no_grad()``, or ``p.data = new``) are kept on exit and broadcast to every rank; None means read-only
    (edits are dropped on release). ``enabled=False`` makes the block a no-op. Do not run the model's forward inside
    the block: its hooks release units after use. ``fwd_module`` (DeepSpeed) is not supported.
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor | None],
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise NotImplementedError(
                "GatheredParameters(fwd_module=...) is not supported: shardspeed attaches gather hooks once, at "
                "initialize(); use zero.register_external_parameter(module, param) before initialize() instead"
            )
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)):
            raise TypeError(f"GatheredParameters: modifier_rank must be a rank (int) or None, got {modifier_rank!r}")
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        self.params = [p for p in items if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[ParamUnit, PartitionedParam]] = []
        self._gathered: list[ParamUnit] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        from shardspeed.utils.safe_access import engines_of

        for engine in engines_of(self.params):  # stages 1/2: a pending post-step gather lands first
            engine.states.wait_params()
        by_unit: dict[int, tuple[ParamUnit, PartitionedParam]] = {}
        for p in self.params:
            record = partitioned(p)
            unit = record.unit if record is not None else None
            if record is not None and unit is not None:
                by_unit.setdefault(id(unit), (unit, record))
        self._units = sorted(by_unit.values(), key=lambda item: item[0].index)
        if self._units and self.modifier_rank is not None:
            size = self._units[0][0].axis.size
            if not 0 <= self.modifier_rank < size:
                raise ValueError(
                    f"GatheredParameters: modifier_rank {self.modifier_rank} is not a data-parallel rank "
                    f"(valid: 0..{size - 1})"
                )
        for unit, _ in self._units:
            was_sharded = unit.state is UnitState.SHARDED
            unit.ensure_unsharded()
            if was_sharded:
                self._gathered.append(unit)

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        try:
            # On an exception the edit is abandoned: this rank cannot know whether its peers will broadcast.
            if exc_type is None and self.modifier_rank is not None:
                self._publish(self.modifier_rank)
        finally:
            for unit in self._gathered:
                if unit.state is not UnitState.SHARDED:
                    unit.release()
                unit.evict_shard()  # offload_param: an edited shard goes back to its store (no-op otherwise)
            for unit, record in self._units:  # writes inside the block were made on whole parameters
                guard = getattr(record.states_ref(), "placeholder_guard", None)
                if guard is not None:
                    guard.accept(unit)
            self._units, self._gathered = [], []

    @torch.no_grad()
    def _publish(self, source: int) -> None:
        for unit, record in self._units:
            if unit.full is None:
                raise RuntimeError(
                    f"GatheredParameters: ZeRO-3 unit '{unit.name}' was released inside the block (did the model "
                    "run its forward there?); its edits cannot be kept"
                )
            full = unit.full
            unit.pack_params_into(full)
            unit.collectives.broadcast(full, unit.axis, source, tag="gathered_params")
            unit.write_full(full)
            for p, offset, numel, shape in zip(unit.params, unit.offsets, unit.numels, unit.shapes):
                if p.data_ptr() != full[offset:].data_ptr():  # ``p.data = new`` on some rank: back onto the buffer
                    p.data = full[offset : offset + numel].view(shape)
            states = record.states_ref()
            if states is not None:
                states.after_shard_edit(unit)
