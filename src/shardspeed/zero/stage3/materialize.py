"""Materialize a model built under ``zero.Init`` one ZeRO-3 unit at a time, sharding each before the next.

[Note: recorded values first] A tensor whose computation was recorded under the ``zero.Init`` block (every tensor
built inside one: ``init_record.py``) gets its value by replay (``init_replay.py``) when its unit opens or, for a
buffer, when its module comes up: that value already includes the module's own initialization in ``__init__``
(``reset_parameters()`` called there) and anything run later in the block (HF's ``post_init``), so
``reset_parameters()`` is *not* called again for a module whose tensors are all recorded. ``init_fn`` still runs
after, as before (a normal build followed by ``model.apply(init_fn)``). Replay draws from recorded generator
snapshots and leaves the generator where it was, so the schedule below only concerns reset/init_fn calls. The
reset path below remains for meta tensors nothing recorded (created outside any block).

Walk: modules in post-order (children before their parent — the order in which a normal build's constructors
finish and call ``reset_parameters()``, and the order of ``model.apply(init_fn)``), keeping only modules that own a
meta parameter or buffer directly. For each module:
1. open the units it touches: allocate the unit's flat buffer once (padded, uninitialized, NaN-filled for floats)
   and replace its meta parameters by parameters that are views of it, in every module that holds them (ties
   survive), each filled with its recorded value when it has one; the buffer is in the parameters' dtype *at
   creation* (fp32), cast to the training dtype at close;
2. allocate its meta buffers (recorded ones get their replayed value);
3. ``reset_parameters()``, only for a module with a tensor nothing recorded ([Note: recorded values first]) —
   parameters the module did not create (a tie made after construction, e.g. ``head.weight = emb.weight``) are
   swapped for a scratch tensor meanwhile, because in a normal build that reset ran on the module's own,
   since-discarded tensor: it must consume the same random numbers and write nowhere;
4. ``init_fn(module)`` — on the real (tied) parameters: a normal build applies it after tying;
5. close every unit this module was the last to touch: check it was fully written, cast, build its
   ``ParamUnit``, broadcast it from rank 0 and keep this rank's shard (``shard_from_params``), free the buffer.

A unit is touched by the creators of its parameters (and, with an ``init_fn``, by every module holding one), so
for the usual layouts (a stack of blocks) exactly one unit is open at a time; the persistent small-parameter unit
stays open throughout (it is kept whole anyway), and with an ``init_fn`` a tied unit stays open until the last
module that ties it.

[Note: random-number schedule] A normal build consumes the generator in two phases: every constructor's
``reset_parameters()`` (module order), then ``model.apply(init_fn)``. Materializing unit by unit interleaves them.
So when any ``init_fn`` is set, a survey pass first runs every reset and then every ``init_fn`` in the normal
order on scratch copies of one module's tensors at a time, recording the generator state before each call; the
real pass restores the recorded state before each call and the final state at the end. Without an ``init_fn`` the
walk order already is the normal order and no survey runs.

Never garbage: a float parameter or buffer still holding a NaN from the fill (or a non-float buffer nobody wrote),
after every module touching it ran, raises ``UninitializedTensorError`` naming it and how to fix it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.layout import padded_size
from shardspeed.zero.stage3.init import RECORDED, InitFn, RecordedValue, creation_record
from shardspeed.zero.stage3.init_replay import ReplaySession, recorded_of
from shardspeed.zero.stage3.materialize_walk import has_nan, init_fn_of, post_order
from shardspeed.zero.stage3.plan import UnitPlan
from shardspeed.zero.stage3.rng_schedule import RngSchedule, has_reset
from shardspeed.zero.stage3.unit import ParamUnit

BuildUnit = Callable[[int, list[torch.nn.Parameter], torch.Tensor], ParamUnit]
SyncReplicas = Callable[[list[tuple[str, torch.Tensor, torch.Tensor]]], None]
"""Called with (name, the tensor the specs know, its materialized value) for a unit's parameters (the meta original)
or one module's buffers, before the data-axis broadcast: see [Note: replicas under zero.Init] (tensor_parallel)."""

_HOW_TO_FIX = (
    "Tensors created in __init__ under zero.Init live on the meta device and have no values: write them in the "
    "module's reset_parameters(), or pass zero.Init(init_fn=...) a function that fills them (e.g. "
    "torch.nn.init.zeros_ if a checkpoint will overwrite them)."
)


class UninitializedTensorError(RuntimeError):
    """A parameter or buffer built under zero.Init was not written by reset_parameters() or init_fn."""


@dataclass
class _Module:
    path: str
    module: torch.nn.Module
    init_fn: InitFn | None
    created: list[str] = field(default_factory=list)  # direct parameters this module created
    aliases: list[str] = field(default_factory=list)  # direct parameters created by another module
    units: list[int] = field(default_factory=list)  # units its reset/init_fn write into
    replayed: bool = False  # every direct meta tensor has a recorded value: no reset_parameters() call


@dataclass
class _Param:
    original: torch.nn.Parameter  # the meta parameter (kept alive so its id is never reused meanwhile)
    name: str  # canonical name
    unit: int
    creator: torch.nn.Module  # the module whose reset_parameters() initializes it
    holders: list[tuple[torch.nn.Module, str]]  # every (module, attribute) that holds it
    created_dtype: torch.dtype  # dtype at creation: initialization runs in it
    recorded: RecordedValue | None = None  # its value as recorded under zero.Init
    current: torch.nn.Parameter | None = None  # the materialized parameter, once its unit is open

    @property
    def shape(self) -> torch.Size:
        return self.original.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine trains in (the meta parameter was cast to it before materialization)."""
        return self.original.dtype


def materialize_units(
    module: torch.nn.Module,
    plan: UnitPlan,
    ordered_names: list[list[str]],
    device: torch.device,
    build_unit: BuildUnit,
    ctx: CommContext,
    sync_replicas: SyncReplicas | None = None,
    on_sharded: Callable[[ParamUnit], None] | None = None,
) -> list[ParamUnit]:
    """Materialize, initialize and shard every unit; returns the units (sharded) in plan order. Collective.
    ``on_sharded(unit)`` runs as each unit is sharded, before the next has values (offload_param's store takes the
    shard: [Note: offload during construction] in early_offload.py)."""
    materializer = _Materializer(module, plan, ordered_names, device, build_unit, ctx, sync_replicas)
    materializer.on_sharded = on_sharded
    return materializer.run()


class _Materializer:
    def __init__(
        self,
        root: torch.nn.Module,
        plan: UnitPlan,
        ordered_names: list[list[str]],
        device: torch.device,
        build_unit: BuildUnit,
        ctx: CommContext,
        sync_replicas: SyncReplicas | None,
    ) -> None:
        self.plan, self.ordered_names, self.device = plan, ordered_names, device
        self.build_unit, self.ctx, self.sync_replicas = build_unit, ctx, sync_replicas
        self.by_id: dict[int, _Param] = {}  # id(original) and id(materialized parameter) → its facts
        self.by_name: dict[str, _Param] = {}
        in_tree = {id(m) for m in root.modules()}
        holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for m in root.modules():
            for attr, p in m._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((m, attr))
        creator_of: dict[int, torch.nn.Module] = {}
        for name, p in root.named_parameters():
            record = creation_record(p)
            first_holder = holders[id(p)][0][0]
            recorded = record.creator if record is not None else None
            creator = recorded if recorded is not None and id(recorded) in in_tree else first_holder
            creator_of[id(p)] = creator
            dtype = record.dtype if record is not None else p.dtype
            # the creator's binding first: a tie made after the block (head.weight = emb.weight) leaves the other
            # holder bound to its own, since-discarded tensor
            by_creator = sorted(holders[id(p)], key=lambda holder: holder[0] is not creator)
            recorded = recorded_of(by_creator) if p.is_meta else None
            if recorded is not None:
                dtype = recorded.dtype
            info = _Param(p, name, plan.owner[name], creator, holders[id(p)], dtype, recorded)
            self.by_id[id(p)] = self.by_name[name] = info

        self.modules: list[_Module] = []
        self.init_fns: dict[int, InitFn | None] = {}  # id(module) → its init_fn (records die with the meta tensors)
        for path, m in post_order(root):
            direct = [(a, p) for a, p in m._parameters.items() if p is not None]
            metas = any(p.is_meta for _, p in direct) or any(b is not None and b.is_meta for b in m._buffers.values())
            if not metas:
                continue
            entry = _Module(path, m, init_fn_of(m))
            entry.replayed = all(
                recorded_of([(m, attr)]) is not None
                for attr, t in [*m._parameters.items(), *m._buffers.items()]
                if t is not None and t.is_meta
            )
            self.init_fns[id(m)] = entry.init_fn
            for attr, p in direct:
                (entry.created if creator_of[id(p)] is m else entry.aliases).append(attr)
            touching = entry.created + (entry.aliases if entry.init_fn is not None else [])
            entry.units = sorted({self._info(m, attr).unit for attr in touching})
            self.modules.append(entry)
        self.last_touch: dict[int, int] = {}
        for position, entry in enumerate(self.modules):
            for unit in entry.units:
                self.last_touch[unit] = position
        self.open: dict[int, torch.Tensor] = {}  # unit → flat buffer (creation dtype)
        self._spare: torch.Tensor | None = None  # a closed unit's buffer, for the next one (see _take_buffer)
        self.built: dict[int, ParamUnit] = {}
        self.replay = ReplaySession()
        self.root = root
        self.on_sharded: Callable[[ParamUnit], None] | None = None

    # --- walk ----------------------------------------------------------------------------------------------
    def run(self) -> list[ParamUnit]:
        schedule = RngSchedule.survey(self.modules, self.device, self._scratch_all) if self._any_init_fn() else None
        try:
            self._walk(schedule)
        finally:
            for m in self.root.modules():  # the recordings are spent: free their constants and generator snapshots
                RECORDED.pop(m)
            self.replay.close()
        return [self.built[u] for u in range(len(self.plan.units))]

    def _walk(self, schedule: RngSchedule | None) -> None:
        for position, entry in enumerate(self.modules):
            for unit in entry.units:
                if unit not in self.open and unit not in self.built:
                    self._open(unit)
            fresh_buffers = self._allocate_buffers(entry)
            if has_reset(entry.module) and not entry.replayed:
                if schedule is not None:
                    schedule.restore(("reset", position))
                with self._scratch(entry.module, entry.aliases):
                    entry.module.reset_parameters()
            if entry.init_fn is not None:
                if schedule is not None:
                    schedule.restore(("init", position))
                entry.init_fn(entry.module)
            self._finish_buffers(entry, fresh_buffers)
            for unit in sorted(u for u, last in self.last_touch.items() if last == position):
                self._close(unit)
        if schedule is not None:
            schedule.restore_final()
        for unit in range(len(self.plan.units)):  # units no deferred module touched (their tensors had data)
            if unit not in self.built:
                self._open(unit)
                self._close(unit)
        self._spare = None

    def _any_init_fn(self) -> bool:
        return any(entry.init_fn is not None for entry in self.modules)

    def _info(self, module: torch.nn.Module, attr: str) -> _Param:
        return self.by_id[id(module._parameters[attr])]

    # --- units ---------------------------------------------------------------------------------------------
    def _unit_params(self, unit: int) -> list[_Param]:
        return [self.by_name[n] for n in self.ordered_names[unit]]

    @torch.no_grad()
    def _open(self, unit: int) -> None:
        infos = self._unit_params(unit)
        dtypes = {i.created_dtype for i in infos}
        dtype = dtypes.pop() if len(dtypes) == 1 else infos[0].dtype
        numel = sum(i.shape.numel() for i in infos)
        flat = self._take_buffer(padded_size(numel, self.ctx.axis.size), dtype)
        if flat.is_floating_point():
            flat.fill_(float("nan"))
        offset = 0
        for info in infos:
            old = info.original
            view = flat[offset : offset + info.shape.numel()].view(info.shape)
            if not old.is_meta:  # a parameter that already had data (built outside the context)
                view.copy_(old.detach())
            elif info.recorded is not None:
                self.replay.fill(info.recorded, view, "parameter", info.name, info.creator)
            new = torch.nn.Parameter(view, requires_grad=old.requires_grad)
            for holder, attr in info.holders:
                holder._parameters[attr] = new
            info.current = new
            self.by_id[id(new)] = info
            offset += info.shape.numel()
        self.open[unit] = flat

    @torch.no_grad()
    def _close(self, unit: int) -> None:
        flat = created = self.open.pop(unit)
        infos = self._unit_params(unit)
        params = [info.current for info in infos]
        for info, p in zip(infos, params):
            assert p is not None
            unwritten_possible = info.recorded is None or self.replay.maybe_uninitialized(info.recorded)
            if unwritten_possible and p.is_floating_point() and has_nan(p):
                raise UninitializedTensorError(self._uninitialized("parameter", info.name, info.creator))
        if self.sync_replicas is not None:  # parameters that had data were broadcast by the engine already
            self.sync_replicas([(i.name, i.original, p) for i, p in zip(infos, params) if i.original.is_meta])
        target = infos[0].dtype
        if flat.dtype != target:  # created in fp32, trained in bf16: initialize as created, then cast
            flat = flat.to(target)
            offset = 0
            for p in params:
                p.data = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
        built = self.build_unit(unit, [p for p in params if p is not None], flat)
        del flat  # the unit owns the buffer now, and drops it once sharded
        built.shard_from_params(broadcast_from_rank0=True)
        self.built[unit] = built
        if self.on_sharded is not None:
            self.on_sharded(built)
        self._keep_spare(created)
        self.replay.clear()  # intermediates (inv_freq's arange…) are cheap to recompute

    def _take_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for the next unit: the last closed unit's when it fits. Why reuse: the communication backend
        may hold a reference to a broadcast tensor for a moment after the broadcast completed (gloo's worker
        thread does), so a fresh buffer per unit could briefly mean two units alive."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.dtype == dtype and spare.numel() >= numel:
            return spare[:numel]
        del spare
        return torch.empty(numel, dtype=dtype, device=self.device)

    def _keep_spare(self, flat: torch.Tensor) -> None:
        base = flat if flat._base is None else flat._base
        if self._spare is None or base.numel() > self._spare.numel():
            self._spare = base

    # --- buffers -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _allocate_buffers(self, entry: _Module) -> dict[str, tuple[torch.Tensor, int]]:
        fresh: dict[str, tuple[torch.Tensor, int]] = {}
        for attr, b in list(entry.module._buffers.items()):
            if b is None or not b.is_meta:
                continue
            recorded = recorded_of([(entry.module, attr)])
            name = f"{entry.path}.{attr}" if entry.path else attr
            if recorded is not None:  # computed as created (fp32), then cast as the engine cast the meta buffer
                value = torch.empty(b.shape, dtype=recorded.dtype, device=self.device)
                self.replay.fill(recorded, value, "buffer", name, entry.module)
                new = value.to(b.dtype)
                entry.module._buffers[attr] = new
                maybe_unwritten = self.replay.maybe_uninitialized(recorded)
                # a recorded non-float buffer is written unless replay found it never written (which raised)
                fresh[attr] = (new, new._version if maybe_unwritten else -1)
                continue
            new = torch.empty(b.shape, dtype=b.dtype, device=self.device)
            if new.is_floating_point():
                new.fill_(float("nan"))
            entry.module._buffers[attr] = new
            fresh[attr] = (new, new._version)
        return fresh

    @torch.no_grad()
    def _finish_buffers(self, entry: _Module, fresh: dict[str, tuple[torch.Tensor, int]]) -> None:
        finished: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for attr, (allocated, version) in fresh.items():
            now = entry.module._buffers[attr]
            if now is None:
                continue
            if now is allocated:
                unwritten = has_nan(now) if now.is_floating_point() else now._version == version
            else:
                unwritten = now.is_meta
            if unwritten:
                name = f"{entry.path}.{attr}" if entry.path else attr
                raise UninitializedTensorError(self._uninitialized("buffer", name, entry.module))
            if now.device != self.device:
                now = entry.module._buffers[attr] = now.to(self.device)
            finished.append((f"{entry.path}.{attr}" if entry.path else attr, allocated, now))
        if self.sync_replicas is not None and finished:
            self.sync_replicas(finished)
        for _, _, now in finished:
            self.ctx.collectives.broadcast(now, self.ctx.axis, 0, tag="init")

    def _uninitialized(self, kind: str, name: str, module: torch.nn.Module) -> str:
        reset = "has a reset_parameters() that did not write it" if has_reset(module) else "has no reset_parameters()"
        fn = "no init_fn wrote it" if self.init_fns.get(id(module)) is None else "its init_fn did not write it"
        return (
            f"zero.Init: {kind} '{name}' was never initialized: its module {type(module).__name__} {reset} and "
            f"{fn} (it still holds no values, or only some). {_HOW_TO_FIX}"
        )

    # --- scratch tensors -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _scratch(self, module: torch.nn.Module, attrs: list[str]) -> Iterator[None]:
        """Swap ``module``'s parameters ``attrs`` for throw-away tensors of the same shape while the body runs."""
        saved = {attr: module._parameters[attr] for attr in attrs}
        try:
            for attr, p in saved.items():
                assert p is not None
                info = self._info(module, attr)
                scratch = torch.empty(info.shape, dtype=info.created_dtype, device=self.device)
                module._parameters[attr] = torch.nn.Parameter(scratch, requires_grad=p.requires_grad)
            yield
        finally:
            module._parameters.update(saved)

    @contextlib.contextmanager
    def _scratch_all(self, module: torch.nn.Module) -> Iterator[None]:
        """Every meta tensor of ``module`` (parameters and buffers) swapped for scratch (the survey pass)."""
        saved_buffers = {a: b for a, b in module._buffers.items() if b is not None and b.is_meta}
        attrs = [a for a, p in module._parameters.items() if p is not None]
        try:
            for attr, b in saved_buffers.items():
                module._buffers[attr] = torch.empty(b.shape, dtype=b.dtype, device=self.device)
            with self._scratch(module, attrs):
                yield
        finally:
            module._buffers.update(saved_buffers)
