"""ZeRO stage 3 model states: parameters, gradients and optimizer states all exist only as this rank's shards.

Per rank (fp32 Adam): parameter shards 4Ψ/N + gradient shards 4Ψ/N + Adam 8Ψ/N = 16Ψ/N, plus the persistent
small parameters kept whole. bf16/fp16: 2Ψ/N parameter shards + fp32 master shards 4Ψ/N + fp32 gradient
shards 4Ψ/N + 8Ψ/N. The optimizer steps one tensor per (unit, parameter group): a contiguous slice of the unit's
shard, because a unit's parameters are packed group by group.

With ``offload_param`` in fp32 (param_offload.py) those slices are replaced by stand-ins that the streamed
optimizer reaches through ``stepped_access``, and checkpoint pieces of offloaded units carry stand-in values
until ``resident_pieces`` brings their unit's shard in, one unit at a time. Mixed precision with a streamed offload
optimizer hands the fp32 masters to it (``hand_masters_to_optimizer``): the stepped tensors become stand-ins for
the low-precision shards, and frozen parts' checkpoint values are upcast copies of the shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from shardspeed.checkpoint.pieces import Piece
from shardspeed.distributed import local_rank_device
from shardspeed.offload.grad_swap import GradSwap
from shardspeed.offload.stepped_access import stand_in
from shardspeed.precision.norm_weights import NormScope
from shardspeed.zero.grad_markers import SteppedGrads
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.hold import Stage3Hold
from shardspeed.zero.layout import intersect
from shardspeed.zero.stage3.apply_guard import PlaceholderWriteGuard
from shardspeed.zero.stage3.early_offload import OpenParamOffload, unit_shapes
from shardspeed.zero.stage3.grad_norm import grad_sq_sum, nonfinite_grad_names
from shardspeed.zero.stage3.grad_offload import UnitGradSink
from shardspeed.zero.stage3.grads import StagingBudget, UnitGrads
from shardspeed.zero.stage3.id_check import UnitIdCheck
from shardspeed.zero.stage3.init import has_deferred_tensors
from shardspeed.zero.stage3.materialize import SyncReplicas, materialize_units
from shardspeed.zero.stage3.param_offload import ParamOffloader
from shardspeed.zero.stage3.placeholder import explain as explain_placeholder
from shardspeed.zero.stage3.plan import PERSISTENT, plan_units
from shardspeed.zero.stage3.registry import merge_external_parameters, register_units
from shardspeed.zero.stage3.runtime import Stage3Runtime
from shardspeed.zero.stage3.shard_slices import ShardSlices
from shardspeed.zero.stage3.unit import ParamUnit, UnitState
from shardspeed.zero.states import sweep_cleared


class Stage3States(Stage3Hold):
    communicate_every_micro_step = True

    def __init__(
        self,
        module: torch.nn.Module,
        group_of: dict[str, int],
        ctx: CommContext,
        *,
        persistence_threshold: int,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        reduce_bucket_numel: int,
        device: torch.device | None = None,
        leaves: Sequence[str] = (),
        model_persistence_threshold: int | None = None,
        guard_placeholders: bool = True,
        master_dtype: torch.dtype = torch.float32,
        sync_replicas: SyncReplicas | None = None,
        open_param_offload: OpenParamOffload | None = None,
        masters_to_optimizer: bool = False,
    ) -> None:
        """``leaves``: module paths gathered whole as one unit each (leaves.py). ``model_persistence_threshold``:
        cap on the persistent unit's elements (plan.py). ``guard_placeholders``: raise at the next forward when a
        partitioned parameter was written in place (apply_guard.py; ``override_module_apply``). ``sync_replicas``: under
        zero.Init, makes tensor-replicated values equal before each unit is sharded (materialize.py).
        ``open_param_offload``: ``offload_param``'s store, opened before any unit has values and handed each shard
        as soon as it is sharded ([Note: offload during construction] in early_offload.py). ``masters_to_optimizer``:
        a streamed offload optimizer will keep the fp32 masters (``hand_masters_to_optimizer``), so mixed precision
        never builds them here."""
        self.ctx = ctx
        self.norm_scope = NormScope()  # bind_norm: [Note: norm counted once]
        plan = plan_units(module, persistence_threshold, leaves, model_persistence_threshold)
        merge_external_parameters(module, plan)
        no_group = max(group_of.values(), default=-1) + 1
        unit_names = [u.name for u in plan.units]
        # Group by optimizer group inside the unit so each group's slice of the shard is contiguous.
        ordered = [sorted(spec.param_names, key=lambda n: group_of.get(n, no_group)) for spec in plan.units]
        deferred = has_deferred_tensors(module)  # built under zero.Init: still on the meta device
        if deferred and device is None:
            device = _default_device()
        id_device = device if device is not None else next(module.parameters(), torch.empty(0)).device
        # the ids of a CPU collective cost nothing to read: check each at once (see id_check.py)
        self.id_check = UnitIdCheck(ctx.axis, ctx.collectives, unit_names, immediate=id_device.type == "cpu")

        def build_unit(index: int, params: list[torch.nn.Parameter], full: torch.Tensor | None) -> ParamUnit:
            spec = plan.units[index]
            unit = ParamUnit(
                index,
                spec.name,
                params,
                ordered[index],
                ctx.axis,
                ctx.collectives,
                self.id_check,
                device=device,
                full=full,
            )
            unit.persistent = spec.name == PERSISTENT
            return unit

        named = dict(module.named_parameters())
        early: ParamOffloader | None = None  # [Note: offload during construction]
        if open_param_offload is not None:
            early = open_param_offload(unit_shapes(plan, ordered, named, ctx.axis.size, device))

        def sharded(unit: ParamUnit) -> None:
            if early is not None and not unit.persistent:
                unit.start_offload(early)  # written to the store and freed before the next unit has values

        if deferred:  # materialize, initialize and shard one unit at a time (materialize.py)
            assert device is not None
            self.units = materialize_units(module, plan, ordered, device, build_unit, ctx, sync_replicas, sharded)
        else:
            self.units = []
            for i, names in enumerate(ordered):  # one unit's shard allocated at a time
                unit = build_unit(i, [named[n] for n in names], None)
                unit.shard_from_params(broadcast_from_rank0=False)
                sharded(unit)
                self.units.append(unit)
        for unit in self.units:
            if unit.persistent:
                unit.gather()
                unit.wait()
        named = dict(module.named_parameters())
        # one staging budget for every unit's reduce-scatter pieces: reduce_bucket_size in the wire dtype
        self.staging = StagingBudget(reduce_bucket_numel * ctx.comm_dtype.itemsize)
        # gradient shards in the master dtype (bf16 with bf16 master weights: [Note: low-precision masters])
        self.grads = [UnitGrads(u, ctx, self.staging, reduce_bucket_numel, master_dtype) for u in self.units]
        self.reducer = Stage3Runtime(
            self.units,
            self.grads,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
            max_reuse_distance=max_reuse_distance,
            names=list(named),
        )
        self.reducer.attach(module, plan.roots, plan.foreign)
        # leaf units: which parameters get gradients differs between ranks, so reduce them after backward
        self.reducer.reduce_after_backward = {i for i, spec in enumerate(plan.units) if spec.data_dependent}
        self.leaf_units = [spec.name for spec in plan.units if spec.data_dependent]
        mixed = any(u.dtype != master_dtype for u in self.units)  # a separate master copy only then
        self.mixed, self.master_dtype = mixed, master_dtype
        elsewhere = mixed and masters_to_optimizer  # the optimizer's store will hold the fp32 values
        build = mixed and not elsewhere
        self.masters: list[torch.Tensor | None] = [_upcast(u, master_dtype) if build else None for u in self.units]
        self.masters_in_optimizer = False  # hand_masters_to_optimizer
        # a streamed offload optimizer: it keeps the fp32 values (the masters, or fp32 values themselves) in its
        # store, so a GatheredParameters edit must be written there too (after_shard_edit)
        self.master_store: Any = None
        # optimizer tensors: (group → tensors), and per tensor the (param index, start, end) pieces for Lamb
        self.group_tensors: dict[int, list[torch.Tensor]] = {}
        self._segments: dict[int, list[tuple[int, int, int]]] = {}
        self._flat_index: dict[tuple[int, int], int] = {}
        self._unit_tensors: dict[int, list[tuple[torch.Tensor, int, int]]] = {}  # (tensor, unit-flat lo, hi)
        param_index = 0
        for u, (unit, grads) in enumerate(zip(self.units, self.grads)):
            for i in range(len(unit.params)):
                self._flat_index[(u, i)] = param_index
                param_index += 1
            if not grads.trainable:
                continue
            stepped = self.masters[u] if self.masters[u] is not None else unit.shard
            rank_range = (unit.rank_start, unit.rank_start + unit.shard_numel)
            by_group: dict[int, list[int]] = {}
            for i, name in enumerate(unit.names):
                if i in grads.trainable:
                    by_group.setdefault(group_of.get(name, no_group), []).append(i)
            for group, members in by_group.items():
                lo = unit.offsets[members[0]]
                hi = unit.offsets[members[-1]] + unit.numels[members[-1]]
                owned = intersect((lo, hi), rank_range)
                if owned is None:
                    continue
                a, b = owned[0] - unit.rank_start, owned[1] - unit.rank_start
                # an fp32 shard already offloaded, or masters the optimizer will hold: a stand-in now, reached
                # through stepped_access (offload_params / hand_masters_to_optimizer)
                if stepped.numel() and not elsewhere:
                    tensor = stepped[a:b]
                else:
                    tensor = stand_in(b - a, torch.empty(0, dtype=master_dtype, device=unit.device))
                tensor.grad = grads.grad_shard[a:b]
                self._unit_tensors.setdefault(u, []).append((tensor, owned[0], owned[1]))
                self.group_tensors.setdefault(group, []).append(tensor)
                pieces = []
                for i in members:
                    piece = intersect((unit.offsets[i], unit.offsets[i] + unit.numels[i]), owned)
                    if piece:
                        pieces.append((self._flat_index[(u, i)], piece[0] - owned[0], piece[1] - owned[0]))
                self._segments[id(tensor)] = pieces
        self.num_params = param_index
        self._home = {
            name: (u, unit.offsets[i]) for u, unit in enumerate(self.units) for i, name in enumerate(unit.names)
        }
        self.param_offloader: ParamOffloader | None = early  # offload_params finishes the hand-over
        self.grad_sink: UnitGradSink | None = None  # offload_grads
        self.stepped_access: ShardSlices | None = None  # fp32 offload_param: where the stand-ins' values are
        register_units(self)  # for zero.full_shape / GatheredParameters (no attributes on parameters)
        self.placeholder_guard = PlaceholderWriteGuard(self.units, module) if guard_placeholders else None
        if elsewhere:
            self.hand_masters_to_optimizer()

    # --- ModelStates interface -----------------------------------------------------------------------------
    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**g, "params": self.group_tensors.get(i, [])} for i, g in enumerate(groups)]

    @property
    def managed_names(self) -> set[str]:
        """Parameters whose values and optimizer states this stage holds (the rest are saved whole)."""
        return {n for u in self.units for n in u.names}

    def checkpoint_pieces(self) -> list[Piece]:
        """This rank's shard of every unit, cut at parameter boundaries (frozen parameters included)."""
        pieces = []
        for u, unit in enumerate(self.units):
            rank_range = (unit.rank_start, unit.rank_start + unit.shard_numel)
            values = self.masters[u] if self.masters[u] is not None else unit.shard
            for i, name in enumerate(unit.names):
                lo, hi = unit.offsets[i], unit.offsets[i] + unit.numels[i]
                owned = intersect((lo, hi), rank_range)
                if owned is None:
                    continue
                opt_tensor, opt_offset = None, 0
                for tensor, t_lo, t_hi in self._unit_tensors.get(u, []):
                    if t_lo <= owned[0] < t_hi:
                        opt_tensor, opt_offset = tensor, owned[0] - t_lo
                a, b = owned[0] - unit.rank_start, owned[1] - unit.rank_start
                # mixed precision: the fp32 master covers the whole shard (frozen parts too) and is what gets
                # copied back into the low-precision shard after a step or a load. An offloaded fp32 shard is not
                # in memory: a stand-in until resident_pieces swaps the unit in.
                if self.masters_in_optimizer:  # fp32 values in the optimizer's store, or upcast from the shard
                    value = stand_in(b - a, torch.empty(0, dtype=torch.float32, device=unit.device))
                elif self._values_offloaded(unit):
                    value = stand_in(b - a, values)
                else:
                    value = values[a:b]
                pieces.append(
                    Piece(
                        name, tuple(unit.shapes[i]), owned[0] - lo, owned[1] - lo, value, opt_tensor, opt_offset, True
                    )
                )
        return pieces

    def resident_pieces(self, pieces: Iterable[Piece], writing: bool) -> Iterator[Piece]:
        """``pieces`` with every value in memory: an offloaded fp32 unit's shard is read in before its first
        piece and evicted (written back when ``writing``: a checkpoint load fills the values) after its last,
        so checkpoints hold one unit's shard at a time. Pieces must come unit by unit (checkpoint_pieces' order);
        other pieces pass through unchanged."""
        current: ParamUnit | None = None
        try:
            for piece in pieces:
                home = self._home.get(piece.name)
                unit = self.units[home[0]] if home is not None else None
                # masters in the optimizer: its resident_pieces serves stepped pieces; frozen ones are upcast here
                upcast = self.masters_in_optimizer and piece.opt_tensor is None
                if home is None or unit is None or not (upcast or self._values_offloaded(unit)):
                    yield piece
                    continue
                if unit is not current:
                    if current is not None:
                        current.evict_shard()
                    current = unit
                    if writing:
                        unit.writable_shard(keep_values=True)
                    else:
                        unit.fetch_shard()
                a = home[1] + piece.start - unit.rank_start
                if not upcast:
                    yield dataclasses.replace(piece, value=unit.shard[a : a + piece.numel])
                    continue
                value = unit.shard[a : a + piece.numel].float()
                yield dataclasses.replace(piece, value=value)
                if writing:  # the load filled the fp32 copy: into the shard it stands for
                    unit.writable_shard(keep_values=True)[a : a + piece.numel].copy_(value)
        finally:
            if current is not None:
                current.evict_shard()

    def _values_offloaded(self, unit: ParamUnit) -> bool:
        """Whether ``unit``'s fp32 values live in its offload store (fp32 with offload_param, non-persistent)."""
        return unit.offloader is not None and not self.mixed

    def tensor_segments(self) -> dict[int, list[tuple[int, int, int]]]:
        return self._segments

    @property
    def param_names(self) -> list[str]:
        return [name for unit in self.units for name in unit.names]  # the order of _flat_index

    def bind_norm(self, scope: NormScope) -> None:
        self.norm_scope = scope

    def grad_sq_sum(self) -> float:
        return grad_sq_sum(self.units, self.grads, self.norm_scope, self.ctx, self.grad_sink)

    def nonfinite_grad_names(self) -> list[str]:
        return nonfinite_grad_names(self.units, self.grads, self.grad_sink)

    def offload_grads(self, swap: GradSwap) -> None:
        """[Note: gradients on NVMe] in grad_offload.py: every unit's reduced shard goes to ``swap`` (the streamed
        optimizer's swap file) as it is reduced. The stepped tensors' ``.grad`` become stand-ins (the values are
        in the file), so ``optimizer.zero_grad()`` is still seen ([Note: gradient markers])."""
        sink = UnitGradSink(
            swap, self.units, self._unit_tensors, [g.trainable for g in self.grads], lambda: self.norm_scope
        )
        self.grad_sink = sink
        for g in self.grads:
            if g.trainable:
                g.offload_to(sink)
        for entries in self._unit_tensors.values():
            for tensor, _, _ in entries:
                tensor.grad = stand_in(tensor.numel(), tensor)

    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_([g.grad_shard for g in self.grads if g.trainable], factor)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        for unit, master in zip(self.units, self.masters):
            if master is not None:
                unit.writable_shard(keep_values=False).copy_(master)
                if unit.state is UnitState.SHARDED:
                    unit.evict_shard()  # offloaded: written to the store and freed until the next gather
            if unit.persistent:  # kept whole on every rank: refresh it from the updated shards
                unit.release()
                unit.gather()
                unit.wait()

    def offload_params(self, offloader: ParamOffloader) -> None:
        """``offload_param``: every non-persistent unit's shard moves to ``offloader``'s store (param_offload.py).
        Mixed precision: the optimizer and checkpoints use the fp32 masters, never the shards. fp32: call before
        the optimizer is built; its tensors become stand-ins and only an optimizer that goes through
        ``stepped_access`` (offload_optimizer's ``StreamedAdam``) can step them."""
        self.param_offloader = offloader
        fp32 = not self.mixed
        if fp32:
            self.stepped_access = ShardSlices()
        for u, unit in enumerate(self.units):
            if unit.persistent:
                continue
            if fp32:
                self._replace_with_stand_ins(u)
            unit.start_offload(offloader)

    def hand_masters_to_optimizer(self) -> ShardSlices | None:
        """Mixed precision with a streamed offload optimizer (which keeps fp32 values in its store): drop the fp32
        masters; the stepped tensors become stand-ins whose values are reached, through the returned access, as
        the low-precision shards (offloaded or not). Call after ``offload_params``, before the optimizer is
        built."""
        if not self.mixed:
            return None
        if self.masters_in_optimizer:  # already at construction (masters_to_optimizer)
            return self.stepped_access
        self.stepped_access = ShardSlices()
        for u in range(len(self.units)):
            self._replace_with_stand_ins(u)
        self.masters = [None for _ in self.units]
        self.masters_in_optimizer = True
        return self.stepped_access

    def set_final_grads_hook(self, hook: Callable[[list[torch.Tensor]], None]) -> None:
        """``hook(stepped tensors)`` as each unit's reduced gradient of a step is final (offload's host copy)."""
        self.reducer.on_final = lambda u: hook([tensor for tensor, _, _ in self._unit_tensors.get(u, [])])

    @torch.no_grad()
    def after_shard_edit(self, unit: ParamUnit) -> None:
        """``unit``'s shard was edited in place (``GatheredParameters``): make the edit the fp32 values too, or the
        next step would write the old masters back over it."""
        master = self.masters[unit.index]
        if master is not None:
            master.copy_(unit.shard)
        elif self.master_store is not None:
            self.master_store.reseed([tensor for tensor, _, _ in self._unit_tensors.get(unit.index, [])])

    def _replace_with_stand_ins(self, u: int) -> None:
        """Swap unit ``u``'s stepped slices for stand-ins everywhere they are listed, so no reference keeps its
        shard's memory alive once the shard is evicted."""
        assert self.stepped_access is not None
        unit, replaced = self.units[u], {}
        entries = []
        for tensor, lo, hi in self._unit_tensors.get(u, []):
            new = stand_in(tensor.numel(), tensor)
            new.grad = tensor.grad
            self.stepped_access.add(new, unit, lo - unit.rank_start, hi - unit.rank_start)
            self._segments[id(new)] = self._segments.pop(id(tensor))
            replaced[id(tensor)] = new
            entries.append((new, lo, hi))
        self._unit_tensors[u] = entries
        for group, tensors in self.group_tensors.items():
            self.group_tensors[group] = [replaced.get(id(t), t) for t in tensors]

    def close(self) -> None:
        """Release offload storage (the parameter swap file) and the placeholder guard's hooks; the engine calls it
        from ``destroy``."""
        if self.param_offloader is not None:
            self.param_offloader.close()
            self.param_offloader = None
        if self.placeholder_guard is not None:
            self.placeholder_guard.remove()

    def zero_grads(self) -> None:
        self.reducer.zero()

    def _stepped_grads(self) -> SteppedGrads:
        stepped = getattr(self, "_stepped", None)
        if stepped is None:
            stepped = self._stepped = SteppedGrads(
                lambda: [t for entries in self._unit_tensors.values() for t, _, _ in entries],
                lambda: [g.grad_shard for g in self.grads if g.sink is None],  # offloaded: stand-in .grad
            )
            stepped.snapshot()
        return stepped

    def sweep_cleared(self) -> int:
        """[Note: gradient markers]; in-place zeroing reaches every shard there is: nothing more to forget."""
        return sweep_cleared(self.reducer, self._stepped_grads(), self.zero_grads, written_means_all=False)

    def mark_grads_clean(self) -> None:
        self._stepped_grads().snapshot()

    def explain_backward_error(self, error: BaseException, loss: torch.Tensor) -> BaseException:
        """A clear error naming the parameter when ``error`` came from reading an empty placeholder, else
        ``error`` itself."""
        names = {id(p): n for u in self.units for p, n in zip(u.params, u.names)}
        explained = explain_placeholder(error, loss, names)
        return error if explained is None else explained

    def bind_optimizer(self, optimizer: Any, groups: list[dict[str, Any]]) -> None:
        """Nothing to re-lay out: units follow the model's modules, not gradient arrival order."""

    def verify_unit_order(self) -> None:
        """The step boundary: read the queued unit-id checks of this step (one host read; see id_check.py)."""
        self.id_check.verify()

    def wait_params(self) -> None:
        """Nothing pending between steps: units are gathered by their own forward hooks."""

    @property
    def peak_staging_bytes(self) -> int:
        """Peak wire-dtype bytes staged for gradient reduce-scatters: at most reduce_bucket_size × dtype size."""
        return self.staging.peak_bytes

    def buffers(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {
            "param_shards": [u.shard for u in self.units],  # offloaded shards between uses: empty tensors
            "grad_shard": [g.grad_shard for g in self.grads],
            "grad_hold": [g.step_held for g in self.grads if g.step_held is not None],  # during a held step
        }
        if any(m is not None for m in self.masters):
            out["master_shard"] = [m for m in self.masters if m is not None]
        return out

    @property
    def peak_bucket_bytes(self) -> int:
        """Peak gathered (non-persistent) parameters during a pass, in bytes: the working set the prefetch and
        live-parameter settings bound."""
        return self.reducer.peak_live_numel * (self.units[0].shard.element_size() if self.units else 0)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)

    @torch.no_grad()
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The module's whole state dict, gathering one unit at a time (collective: every rank calls it).

        Each unit is gathered, copied out and released before the next, so no rank holds more than the copies
        plus one unit. Tied parameters appear under every name, as in ``module.state_dict()``.
        """
        by_id: dict[int, torch.Tensor] = {}
        for unit in self.units:
            was_sharded = unit.state is UnitState.SHARDED
            unit.ensure_unsharded()
            for p in unit.params:
                by_id[id(p)] = p.detach().clone()
            if was_sharded:
                unit.release()
        state = module.state_dict(keep_vars=True)
        return {name: by_id.get(id(t), t.detach()) for name, t in state.items()}

    def unsharded_units(self) -> list[str]:
        return [u.name for u in self.units if u.state is not UnitState.SHARDED and not u.persistent]


@torch.no_grad()
def _upcast(unit: ParamUnit, dtype: torch.dtype) -> torch.Tensor:
    """``unit``'s shard in ``dtype`` (the masters), read back from the store and evicted again if offloaded."""
    resident = unit.shard_resident
    unit.fetch_shard()
    master = unit.shard.to(dtype)
    if not resident:
        unit.evict_shard()  # unchanged: nothing written back
    return master


def _default_device() -> torch.device:
    """The engine's device rule, for a meta model (it carries no device of its own) when none was passed."""
    return local_rank_device()
