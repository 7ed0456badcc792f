"""ZeRO-3 runtime: module hooks that gather units before they run and release them after, plus the backward
protocol the engine drives (same interface as zero/reducer.py's GradReducer).

Per forward pass:  unit-root pre-forward → acquire (gather, wait; prefetch the next units of the order
recorded in the previous pass) · post-forward → release (unless reused soon) and wrap the outputs in an
identity autograd function whose backward re-gathers the unit before its gradients are computed.
Per backward:      pre-backward (from that function) → gather again, prefetch along the recorded backward
order · every trainable parameter's gradient hook → stage it; when a unit's gradients are all in → launch its
reduce-scatter (waiting for all but the newest REDUCE_SCATTERS_IN_FLIGHT, whose staging buffers would otherwise
add up to the whole model) and release its parameters · after autograd returns → reduce leftover units (unused
parameters: zero gradients) in unit order, wait, release everything not persistent.
Evaluation (``torch.no_grad()``) uses only the forward half: nothing waits for a backward that never comes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardspeed.zero.stage3.grads import UnitGrads
from shardspeed.zero.stage3.saved_views import SavedViewHooks
from shardspeed.zero.stage3.unit import ParamUnit, UnitState


class _PreBackward(torch.autograd.Function):
    """Identity in forward; its backward runs just before the wrapped module's backward and gathers its units."""

    @staticmethod
    def forward(ctx: Any, runtime: Stage3Runtime, unit_ids: tuple[int, ...], *tensors: torch.Tensor) -> Any:
        ctx.runtime, ctx.unit_ids = runtime, unit_ids
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.runtime.pre_backward(ctx.unit_ids)
        return (None, None, *grads)


REDUCE_SCATTERS_IN_FLIGHT = 2  # overlap a reduce-scatter with the next units' backward, without holding them all


class Stage3Runtime:
    def __init__(
        self,
        units: Sequence[ParamUnit],
        grads: Sequence[UnitGrads],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        names: Sequence[str],
    ) -> None:
        self.units, self.grads = list(units), list(grads)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.names = list(names)
        self.overlap = True
        self._refs = [0] * len(self.units)
        self._fwd_order: list[int] = []  # units in the order the previous forward acquired them
        self._fwd_now: list[int] = []
        self._bwd_order: list[int] = []
        self._bwd_now: list[int] = []
        self._in_backward = False
        self._communicate = True
        self._reduced = False
        self._final = False  # before_backward(final=...)
        self.on_final: Callable[[int], None] | None = None  # unit index → its reduced shard is final (offload)
        self._launched: list[int] = []
        self._finished_count = 0
        self._arrived_since_zero: set[str] = set()
        self._handles: list[Any] = []
        self.peak_live_numel = 0
        self._saved_views = SavedViewHooks(self.units)
        # Units holding a ZeRO-3 leaf (plan.UnitSpec.data_dependent): ranks may get gradients for different subsets
        # of their parameters, so "all arrived" happens at different points per rank; they are reduced with the
        # leftovers after autograd returns (in unit order, the same on every rank).
        self.reduce_after_backward: set[int] = set()

    # --- hook registration -------------------------------------------------------------------------------
    def attach(self, module: torch.nn.Module, roots: dict[str, int], foreign: dict[str, list[int]]) -> None:
        modules = dict(module.named_modules(remove_duplicate=False))
        needs: dict[str, list[int]] = {}
        for path, unit in roots.items():
            needs.setdefault(path, []).append(unit)
        for path, units in foreign.items():
            needs.setdefault(path, []).extend(u for u in units if u not in needs.get(path, []))
        # [Note: hooks run eagerly under torch.compile] Every forward hook is excluded from tracing: a compiled model
        # (torch.compile(model) before or after initialize) graph-breaks at each hook, which then gathers, releases
        # and wraps outputs eagerly, and the module bodies between hooks are compiled with whole parameters as graph
        # inputs (as FSDP2 keeps its collectives outside compiled regions). Traced, the hooks' ``p.data`` swaps
        # would be baked into the graph: "size of tensor a (0) must match" in backward. (The wrapper imports
        # torch._dynamo once per process: a few seconds at the first ZeRO-3 initialize.)
        eager = torch.compiler.disable
        for path, unit_ids in needs.items():
            m = modules[path]
            ids = tuple(unit_ids)
            self._handles.append(m.register_forward_pre_hook(eager(functools.partial(self._pre_forward, ids))))
            self._handles.append(m.register_forward_hook(eager(functools.partial(self._post_forward, ids))))
        self._handles.append(module.register_forward_pre_hook(eager(self._root_pre_forward)))
        self._handles.append(module.register_forward_hook(eager(self._root_post_forward)))
        for u, unit in enumerate(self.units):
            for i, p in enumerate(unit.params):
                if p.requires_grad:
                    hook = functools.partial(self._on_grad, u, i)
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # --- forward -----------------------------------------------------------------------------------------
    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._fwd_now = []
        self._saved_views.enter()  # see [Note: saved views]

    def _root_post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._saved_views.leave()
        if self._fwd_now:
            self._fwd_order = self._fwd_now
        # Units kept for reuse or prefetched but never used this pass are released now: nothing leaks.
        for u, unit in enumerate(self.units):
            if not unit.persistent and self._refs[u] == 0 and unit.state is not UnitState.SHARDED:
                unit.release()

    def _pre_forward(self, unit_ids: tuple[int, ...], module: torch.nn.Module, args: Any) -> None:
        for u in unit_ids:
            self._acquire(u, self._fwd_now, self._fwd_order)

    def _post_forward(self, unit_ids: tuple[int, ...], module: torch.nn.Module, args: Any, output: Any) -> Any:
        for u in unit_ids:
            self._refs[u] -= 1
            if self._refs[u] == 0 and not self._reused_soon(u):
                self.units[u].release()
        if torch.is_grad_enabled():
            output = _wrap_outputs(output, self, unit_ids)
        return output

    def _acquire(self, u: int, now: list[int], previous: list[int]) -> None:
        unit = self.units[u]
        if not unit.persistent:
            now.append(u)
        self._refs[u] += 1
        unit.ensure_unsharded()
        self._prefetch_after(now, previous)
        live = sum(x.numel for x in self.units if x.state is not UnitState.SHARDED)
        self.peak_live_numel = max(self.peak_live_numel, live)

    def _prefetch_after(self, now: list[int], previous: list[int]) -> None:
        """Gather the next units of the previous pass's order while this one computes — only while this pass has
        followed that order exactly (so every rank prefetches the same units, in the same order)."""
        if self.prefetch_numel <= 0 or not now or previous[: len(now)] != now:
            return
        budget = self.prefetch_numel
        live = sum(x.numel for x in self.units if x.state is not UnitState.SHARDED)
        for u in previous[len(now) :]:
            unit = self.units[u]
            if unit.state is UnitState.SHARDED:
                if unit.numel > budget or live + unit.numel > self.max_live_numel:
                    return
                unit.gather()
                live += unit.numel
            budget -= unit.numel
            if budget <= 0:
                return

    def _reused_soon(self, u: int) -> bool:
        """Whether unit u is used again later in this forward within max_reuse_distance gathered elements."""
        if self.max_reuse_distance <= 0:
            return False
        order, position = self._fwd_order, len(self._fwd_now)
        distance = 0
        for later in order[position:]:
            if later == u:
                return True
            distance += self.units[later].numel
            if distance > self.max_reuse_distance:
                return False
        return False

    # --- backward ----------------------------------------------------------------------------------------
    def pre_backward(self, unit_ids: tuple[int, ...]) -> None:
        for u in unit_ids:
            if self.grads[u].launched:
                continue
            if self.units[u].state is not UnitState.UNSHARDED or u not in self._bwd_now:
                self._acquire_for_backward(u)

    def _acquire_for_backward(self, u: int) -> None:
        unit = self.units[u]
        if not unit.persistent and u not in self._bwd_now:
            self._bwd_now.append(u)
        unit.ensure_unsharded()
        self._prefetch_after(self._bwd_now, self._bwd_order)

    def _on_grad(self, u: int, i: int, param: torch.nn.Parameter) -> None:
        grads = self.grads[u]
        self._arrived_since_zero.add(f"{u}:{i}")
        if grads.launched:
            raise RuntimeError(
                f"gradient for '{self.units[u].names[i]}' arrived after its ZeRO-3 unit '{self.units[u].name}' "
                "was already reduced in this backward. Compute one loss per backward."
            )
        grads.absorb(i, param)
        if self._communicate and grads.complete:
            if u not in self.reduce_after_backward:
                self._launch(u)
            unit = self.units[u]
            frozen_inside = len(grads.trainable) < len(unit.params)
            if not unit.persistent and not frozen_inside:
                unit.release()

    def _launch(self, u: int) -> None:
        self.grads[u].launch()
        self._launched.append(u)
        # Each reduce-scatter in flight holds its unit's padded staging buffer: finish all but the newest few
        # as backward goes, so gradient memory stays a few units instead of the whole model until the end.
        while len(self._launched) - self._finished_count > REDUCE_SCATTERS_IN_FLIGHT:
            self._finish_grads(self._launched[self._finished_count])
            self._finished_count += 1

    def _finish_grads(self, u: int) -> None:
        """Wait for unit ``u``'s reduce-scatter; in a final backward, hand its reduced shard to ``on_final`` (once:
        a unit's reduce-scatter is launched, so finished, once per backward)."""
        if self.grads[u].finish() and self._final and self.on_final is not None:
            self.on_final(u)

    def before_backward(self, communicate: bool, final: bool = False) -> None:
        """``final``: this backward's reduction is the last before the optimizer step (``on_final`` fires)."""
        assert not self._in_backward, "before_backward called twice without after_backward"
        self._in_backward, self._communicate, self._reduced = True, communicate, False
        self._final = final and communicate
        self._bwd_now, self._launched = [], []
        self._finished_count = 0  # _launched[:_finished_count] have been finished already
        for g in self.grads:
            g.reset_backward()

    def after_backward(self) -> None:
        assert self._in_backward, "after_backward without before_backward"
        self._in_backward = False
        if self._bwd_now:
            self._bwd_order = self._bwd_now
        if self._communicate:
            for g in self.grads:  # leftovers (unused parameters) in a fixed order on every rank
                if not g.launched and g.trainable:
                    g.launch()
            for u, g in enumerate(self.grads):
                if g.trainable:
                    self._finish_grads(u)
            self._reduced = True
        for unit in self.units:
            if not unit.persistent and unit.state is not UnitState.SHARDED:
                unit.release()

    def abort_backward(self) -> None:
        if not self._in_backward:
            return
        self._in_backward = False
        for g in self.grads:
            g.finish()
        for unit in self.units:
            if not unit.persistent and unit.state is not UnitState.SHARDED:
                unit.release()

    @property
    def reduced(self) -> bool:
        return self._reduced

    def unused_names(self) -> list[str]:
        out = []
        for u, (unit, g) in enumerate(zip(self.units, self.grads)):
            out += [unit.names[i] for i in sorted(g.trainable) if f"{u}:{i}" not in self._arrived_since_zero]
        return out

    def zero(self) -> None:
        self._arrived_since_zero.clear()
        self._reduced = False
        for g in self.grads:
            g.zero()


def _wrap_outputs(output: Any, runtime: Stage3Runtime, unit_ids: tuple[int, ...]) -> Any:
    """Route the module's differentiable outputs through _PreBackward (tensors, or tuples/lists/dicts of them)."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            return _PreBackward.apply(runtime, unit_ids, output)[0]
        return output
    if isinstance(output, (tuple, list, dict)):
        items = list(output.values()) if isinstance(output, dict) else list(output)
        slots = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return output
        wrapped = _PreBackward.apply(runtime, unit_ids, *(items[i] for i in slots))
        for i, t in zip(slots, wrapped):
            items[i] = t
        if isinstance(output, dict):
            return type(output)(zip(output.keys(), items)) if type(output) is dict else _rebuild_mapping(output, items)
        return type(output)(items) if type(output) in (tuple, list) else type(output)(*items)
    return output


def _rebuild_mapping(output: Any, items: list[Any]) -> Any:
    for key, value in zip(list(output.keys()), items):
        output[key] = value
    return output
