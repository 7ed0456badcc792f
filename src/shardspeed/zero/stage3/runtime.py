"""ZeRO-3 runtime: module hooks that gather units before they run and release them when nothing needs them, plus
the backward protocol the engine drives (same interface as zero/reducer.py's GradReducer). This file is the hook
protocol (*when* a unit is needed); what is gathered ahead and what is evicted (prefetch, read-ahead, reuse,
``stage3_max_live_parameters``, the peak figures) is prefetch.py's ``GatherPolicy``.

Per forward pass:  unit-root pre-forward → acquire (gather, wait; prefetch the next units of the order recorded
in the previous pass; read ahead the shard after those when parameters are offloaded) and watch the call's
inputs · post-forward → release (unless reused soon) and mark the outputs, whose backward re-gathers the unit.
Per backward:      a call's output mark → its backward use starts: gather, prefetch along the recorded backward
order · its inputs' gradients computed → the use ends · every trainable gradient → stage it; when a unit's
gradients are all in → launch its reduce-scatter (waiting for all but the newest REDUCE_SCATTERS_IN_FLIGHT, whose
staging buffers would otherwise add up to the whole model) · a unit nobody needs any more is released ([Note:
unit lifetime] in needs.py, [Note: backward uses] in marks.py) · after autograd returns → reduce leftover units
(unused parameters: zero gradients) in unit order, wait, release everything not persistent.
Forward passes that run *during* backward are recomputations (activation checkpointing): they gather what they
use and hold it until the backward use they serve ends, and never count on their post-forward hook being reached.
Evaluation (``torch.no_grad()``) uses only the forward half: nothing waits for a backward that never comes.
A pipeline step holds instead ([Note: step-scoped hold] in zero/hold.py): after ``begin_hold`` nothing is released
until ``reduce_held`` (one gather per unit per step), backward passes with ``communicate=False`` accumulate into each
unit's fp32 held gradient, and ``reduce_held`` reduce-scatters every unit once, in unit order. Forwards of later
micro-batches may run while an earlier micro-batch's graph is alive (1F1B): the end of a backward keeps the uses
still to come, so their own backward ends them.
Every gather is issued in an order all ranks share (program order of hooks and autograd nodes), so the
collectives stay matched; releases only decide *when* a unit is gathered again, never in which order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardspeed.zero.grad_markers import GradMarkers
from shardspeed.zero.stage3.grads import UnitGrads
from shardspeed.zero.stage3.marks import BackwardUse, mark_outputs, watch_inputs
from shardspeed.zero.stage3.needs import UnitNeeds
from shardspeed.zero.stage3.prefetch import GatherPolicy
from shardspeed.zero.stage3.saved_views import SavedViewHooks
from shardspeed.zero.stage3.unit import ParamUnit, UnitState

_Calls = list[BackwardUse | None]  # one hooked module's calls in progress (None: a call without grad)

REDUCE_SCATTERS_IN_FLIGHT = 2  # overlap a reduce-scatter with the next units' backward, without holding them all


def _will_run(node: Any) -> bool:
    """Whether the running backward will execute autograd ``node``."""
    return node is not None and torch._C._will_engine_execute_node(node)


def _during_backward() -> bool:
    """Whether the autograd engine is running this code (a recomputation inside backward)."""
    return torch._C._current_graph_task_id() != -1


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
        self._policy = GatherPolicy(
            units, prefetch_numel=prefetch_numel, max_live_numel=max_live_numel, max_reuse_distance=max_reuse_distance
        )
        self.names = list(names)
        self.overlap = True
        self._needs = [UnitNeeds() for _ in self.units]
        self._stacks: list[_Calls] = []  # per hooked module: its calls in progress
        self._uses: list[BackwardUse] = []  # uses with an input hook, removed when the backward ends
        self._unstarted: list[list[BackwardUse]] = [[] for _ in self.units]  # marked uses whose backward is to come
        self._in_backward = False
        self._backward_index = 0  # before_backward calls so far (a retained graph's uses start again)
        self._communicate = True
        self._holding = False  # [Note: step-scoped hold] in zero/hold.py: gathered units stay until reduce_held
        self._reduced = False
        self._final = False  # before_backward(final=...)
        self.on_final: Callable[[int], None] | None = None  # unit index → its reduced shard is final (offload)
        self._launched: list[int] = []
        self._finished_count = 0
        self._arrived_since_zero: set[str] = set()
        self._handles: list[Any] = []
        self._saved_views = SavedViewHooks(self.units)
        # Units holding a ZeRO-3 leaf (plan.UnitSpec.data_dependent): ranks may get gradients for different subsets
        # of their parameters, so "all arrived" happens at different points per rank; they are reduced with the
        # leftovers after autograd returns (in unit order, the same on every rank).
        self.reduce_after_backward: set[int] = set()
        # loss.backward(): the first hook of an unannounced backward starts it (training/backward_passes.py)
        self.backward_starter: Callable[[], None] | None = None
        # [Note: gradient markers] over every trainable parameter, in (unit, local index) order
        self._marked = [(u, i) for u, g in enumerate(self.grads) for i in sorted(g.trainable)]
        self._marker_of = {key: m for m, key in enumerate(self._marked)}
        self.markers = GradMarkers([self.units[u].params[i] for u, i in self._marked])

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
            stack: _Calls = []
            self._stacks.append(stack)
            pre = eager(functools.partial(self._pre_forward, ids, stack))
            self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(eager(functools.partial(self._post_forward, ids, stack))))
        # The root's own hooks bracket its unit hooks (a root that owns parameters is a unit root too): the pass
        # is reset before the root unit is acquired, and ends after it was released.
        self._handles.append(module.register_forward_pre_hook(eager(self._root_pre_forward), prepend=True))
        self._handles.append(module.register_forward_hook(eager(self._root_post_forward)))
        for u, unit in enumerate(self.units):
            for i, p in enumerate(unit.params):
                if p.requires_grad:
                    hook = functools.partial(self._on_grad, u, i)
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))
                    self._handles.append(p.register_hook(functools.partial(self._before_accumulate, u, i)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._drop_uses()

    # --- forward -----------------------------------------------------------------------------------------
    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if _during_backward():  # the whole model recomputed: its unit hooks do the work
            return
        self._policy.start_forward()
        for stack in self._stacks:  # calls a raised exception left open (a failed forward, a stopped recompute)
            stack.clear()
        for needs in self._needs:
            needs.forward_calls = 0
        self._prune_uses()
        self._saved_views.enter()  # see [Note: saved views]

    def _root_post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _during_backward():
            return
        self._saved_views.leave()
        self._policy.end_forward()
        # Units kept for reuse or prefetched but never used this pass are released now: nothing leaks.
        for u in range(len(self.units)):
            self._release_if_idle(u)
        self._policy.cancel_reads_ahead()

    def _pre_forward(
        self, unit_ids: tuple[int, ...], stack: _Calls, module: torch.nn.Module, args: Any, kwargs: Any
    ) -> None:
        recompute = _during_backward()
        for u in unit_ids:
            if recompute:  # held until the backward use it serves ends (its post-forward may never run)
                self._needs[u].recompute_hold = True
            else:
                self._needs[u].forward_calls += 1
            self._acquire(u, backward=recompute)
        use = None
        if torch.is_grad_enabled():
            use = BackwardUse(unit_ids)
            use.handle = watch_inputs(args, kwargs, use, self._use_ended)
            if use.handle is not None:
                self._uses.append(use)
        stack.append(use)

    def _post_forward(
        self, unit_ids: tuple[int, ...], stack: _Calls, module: torch.nn.Module, args: Any, output: Any
    ) -> Any:
        use = stack.pop() if stack else None
        if not _during_backward():
            for u in unit_ids:
                needs = self._needs[u]
                needs.forward_calls = max(0, needs.forward_calls - 1)
                if not self._policy.reused_soon(u):
                    self._release_if_idle(u)
        if use is not None and torch.is_grad_enabled():
            output, marked = mark_outputs(output, use, self._use_started)
            if marked:
                for u in unit_ids:
                    self._unstarted[u].append(use)
        return output

    def _acquire(self, u: int, backward: bool) -> None:
        self._policy.acquire(u, backward, must_stay=self._must_stay)

    def _release_if_idle(self, u: int) -> None:
        """Release unit u unless something needs it, or it waits between two backward uses (see ``_must_stay``)."""
        unit = self.units[u]
        if self._holding:
            return
        if not unit.persistent and unit.state is not UnitState.SHARDED and not self._needs[u].needed:
            unit.release()

    def _must_stay(self, u: int) -> bool:
        """Whether ``stage3_max_live_parameters`` may not evict unit u: it is in use, or its gradients may be
        accumulated before anything gathers it again. A unit whose gradients are pending but whose next backward
        use is still to come (a module called twice, a tied weight) may go: that use gathers it again before the
        accumulation can run (it waits for that use's nodes). Until room is needed it stays, like a unit kept for
        reuse in forward: it would only be gathered again."""
        needs = self._needs[u]
        return self._holding or needs.busy or (needs.grads_pending and not self._use_coming(u))

    def _use_coming(self, u: int) -> bool:
        """Whether a backward use of unit u created in forward is still to start in this backward."""
        return any(use.pending and _will_run(use.node()) for use in self._unstarted[u])

    # --- backward ----------------------------------------------------------------------------------------
    def _start_if_unannounced(self) -> None:
        if not self._in_backward and self.backward_starter is not None:
            self.backward_starter()

    def _before_accumulate(self, u: int, i: int, grad: torch.Tensor) -> None:
        self._start_if_unannounced()
        self.markers.before_accumulate(self._marker_of[(u, i)])

    def _use_started(self, use: BackwardUse) -> None:
        """A call's backward begins (its output mark fired): its units are needed until the use ends."""
        self._start_if_unannounced()
        if use.started_in == self._backward_index and not use.ended:
            return  # several outputs' marks of one call share one use
        use.started, use.ended, use.started_in = True, False, self._backward_index
        backward = _during_backward()
        for u in use.units:
            if use in self._unstarted[u]:
                self._unstarted[u].remove(use)
        for u in use.units:
            needs = self._needs[u]
            if use.marked:
                needs.backward_uses += 1
            else:
                needs.unmarked_uses += 1
            needs.expected |= self._grads_to_come(u)
            self._acquire(u, backward=backward)

    def _use_ended(self, use: BackwardUse) -> None:
        """The gradients of a call's inputs are computed: the module's backward for that call is done."""
        if not use.started or use.ended:
            return  # a recomputation's discarded graph, or a second firing
        use.ended = True
        for u in use.units:
            self._needs[u].end_use()
            self._release_if_idle(u)

    def _grads_to_come(self, u: int) -> set[int]:
        """Trainable parameters of unit u whose gradient this backward will still accumulate."""
        arrived = self._needs[u].arrived
        out = set()
        for i in self.grads[u].trainable:
            if i in arrived:
                continue
            node = torch.autograd.graph.get_gradient_edge(self.units[u].params[i]).node
            if torch._C._will_engine_execute_node(node):
                out.add(i)
        return out

    def _on_grad(self, u: int, i: int, param: torch.nn.Parameter) -> None:
        grads = self.grads[u]
        self._arrived_since_zero.add(f"{u}:{i}")
        if grads.launched:
            raise RuntimeError(
                f"gradient for '{self.units[u].names[i]}' arrived after its ZeRO-3 unit '{self.units[u].name}' "
                "was already reduced in this same backward (the parameter was reached again after all of its "
                "unit's gradients were in, e.g. through a second autograd graph joined into this backward). "
                "Run separate backward passes instead: gradients of several backward passes accumulate."
            )
        if self._communicate:
            grads.absorb(i, param)
        else:  # kept for a later reduction in the master dtype ([Note: step-scoped hold] in zero/hold.py)
            grads.hold(i, param)
        self.markers.install(self._marker_of[(u, i)])
        if self._communicate and grads.complete and u not in self.reduce_after_backward:
            self._launch(u)
        self._needs[u].grad_arrived(i)
        self._release_if_idle(u)

    def _launch(self, u: int, held: bool = False) -> None:
        if held:
            self.grads[u].launch_held()
        else:
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
        self._backward_index += 1
        self._final = final and communicate
        self._policy.start_backward()
        self._launched = []
        self._finished_count = 0  # _launched[:_finished_count] have been finished already
        for g in self.grads:
            g.reset_backward()
        for needs in self._needs:
            needs.reset_backward()

    def after_backward(self) -> None:
        assert self._in_backward, "after_backward without before_backward"
        self._in_backward = False
        self._policy.end_backward()
        if self._communicate:
            for g in self.grads:  # leftovers (unused parameters) in a fixed order on every rank
                if not g.launched and g.trainable:
                    g.launch()
            for u, g in enumerate(self.grads):
                if g.trainable:
                    self._finish_grads(u)
            self._reduced = True
        self._end_backward()

    def _end_backward(self) -> None:
        """Units whose backward never ran (or whose use no mark could end) are released here (held: kept). Uses
        whose backward is still to come (a later micro-batch's forward, run while this backward's graph was alive:
        1F1B) keep their input hooks, so their backward ends them as usual."""
        self._prune_uses(keep_started=False)
        for stack in self._stacks:
            stack.clear()
        for needs in self._needs:
            needs.reset_backward()
        if not self._holding:
            self.release_gathered()
        self._policy.cancel_reads_ahead()

    def release_gathered(self) -> None:
        for unit in self.units:
            if not unit.persistent and unit.state is not UnitState.SHARDED:
                unit.release()

    # --- the step-scoped hold ([Note: step-scoped hold] in zero/hold.py) ---------------------------------------
    def begin_hold(self) -> None:
        """From now until ``reduce_held``/``end_hold``, a unit gathered by its first use stays gathered."""
        self._holding = True

    def reduce_held(self) -> None:
        """Reduce-scatter every unit's held gradients once, in unit order (the same on every rank), as a final
        backward does (``on_final`` fires, ``reduced`` after), then release the units the hold kept."""
        assert not self._in_backward, "reduce_held during a backward"
        self._reduced, self._final = False, True
        self._launched, self._finished_count = [], 0
        for u, g in enumerate(self.grads):
            if g.trainable:
                self._launch(u, held=True)
        for u in self._launched[self._finished_count :]:
            self._finish_grads(u)
        self._reduced, self._final = True, False
        self.end_hold()

    def end_hold(self) -> None:
        self._holding = False
        self.release_gathered()

    def _prune_uses(self, keep_started: bool = True) -> None:
        """Forget uses whose graph is gone (a forward with grad but no backward): their backward never comes.
        ``keep_started`` False (end of a backward): uses it started are over too."""
        for uses in self._unstarted:
            uses[:] = [use for use in uses if use.pending]
        alive = []
        for use in self._uses:
            if use.pending or (keep_started and use.started and not use.ended):
                alive.append(use)
            elif use.handle is not None:
                use.handle.remove()
                use.handle = None
        self._uses = alive

    def _drop_uses(self) -> None:
        for use in self._uses:
            if use.handle is not None:
                use.handle.remove()
                use.handle = None
        self._uses.clear()

    def abort_backward(self) -> None:
        if not self._in_backward:
            return
        self._in_backward = False
        for g in self.grads:
            g.finish()
        self._end_backward()

    # --- figures (prefetch.py keeps them) -----------------------------------------------------------------------
    @property
    def peak_live_numel(self) -> int:
        """Gathered elements at most, since the last ``reset_peaks``."""
        return self._policy.peak_live_numel

    @property
    def peak_live_forward(self) -> int:
        return self._policy.peak_live_forward

    @property
    def peak_live_backward(self) -> int:
        return self._policy.peak_live_backward

    def reset_peaks(self) -> None:
        self._policy.reset_peaks()

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
        self.markers.uninstall_all()  # nothing held: nothing to clear until the next gradient installs a marker

    def forget(self, indices: list[int]) -> None:
        """User code cleared these (marker-numbered) parameters' ``.grad``: drop their reduced shard pieces."""
        assert not self._in_backward, "forget during backward"
        for m in indices:
            u, i = self._marked[m]
            self.grads[u].forget(i)
            self.markers.uninstall(m)
