"""One profiling window: FLOPs per module and phase (``FlopCounterMode``), forward latency per module (module
hooks), parameters per module (full counts under ZeRO-3).

[Note: counting without monkey-patching] DeepSpeed's profiler replaces ``torch.nn.functional.*`` and tensor methods
for the profiled window. Here the counting is torch's own: ``FlopCounterMode`` is a ``TorchDispatchMode`` (every
aten op passes through it) and its ``ModuleTracker`` attributes each op to the modules running it — through global
module hooks in forward and gradient hooks in backward. The only thing we add is formulas for the ops torch's table
lacks (``formulas.py``, passed as the mode's ``custom_mapping``), per-module forward timing hooks and, for the
backward latency, gradient hooks on each call's outputs and inputs (``register_multi_grad_hook``, as the tracker
does), all removed when the window closes. Consequences worth knowing: only ops with a formula count (matmuls,
convolutions, attention): element-wise work — LayerNorm, GELU, softmax, the loss — counts 0, unlike DeepSpeed's
per-functional estimates; and every counted op is multiply-accumulate work, so ``MACs = FLOPs / 2`` exactly.

The window is opened once (``start``) and split into phases by ``begin_phase`` / ``end_phase`` (the engine's
``forward`` / ``backward`` / ``step``): counts are snapshotted at each boundary, so work done between phases (a
user's loss outside the engine) is not charged to either. A module forward that runs *inside* a backward phase is
activation-checkpointing recompute: its FLOPs are also summed apart (``recompute_flops``), so the model FLOPs
(``forward + backward − recompute``) and the hardware FLOPs can both be reported.

[Note: measuring recompute] The recompute window is the outermost module forward that starts inside a backward
phase, until that module's forward hook. Torch's non-reentrant checkpoint normally stops a recompute as soon as the
last saved tensor it needs exists (by raising inside the forward), so the window would never close; while a
session is open it sets ``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` (a torch context manager, read
when each checkpointed forward runs) so recompute runs whole: the same values, a little more work in the profiled
step only. A recompute that is not a module call (a bare function checkpointed) is counted as backward.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from shardspeed.profiling.formulas import custom_mapping

ParamCount = Callable[[nn.Parameter], int]


def full_param_count(param: nn.Parameter) -> int:
    """Elements of ``param`` when whole: ZeRO-3's registry knows the real shape of a partitioned placeholder."""
    from shardspeed.zero.api import full_numel  # lazily: the profiler is usable without the engine's packages

    return full_numel(param)


_WARM = False


def warm_up_mode() -> None:
    """The first op under a ``FlopCounterMode`` imports torch._dynamo (~seconds); do it before the window opens so
    the profiled latencies do not include it. Once per process."""
    global _WARM
    if not _WARM:
        with FlopCounterMode(display=False):
            torch.mm(torch.ones(1, 1), torch.ones(1, 1))
        _WARM = True


@dataclass
class ModuleStats:
    """One module's share of the window."""

    path: str
    """Dotted path from the root ("" for the root)."""
    module: nn.Module
    depth: int
    params: int
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_latency: float = 0.0
    """Seconds inside this module's forward (all calls in forward phases)."""
    bwd_latency: float = 0.0
    """Seconds from the first gradient reaching this module's outputs to the last one leaving its inputs (calls
    whose inputs need a gradient; the root: the whole backward phase)."""

    @property
    def macs(self) -> int:
        return self.fwd_flops // 2


@dataclass
class PhaseTotals:
    flops: int = 0
    seconds: float = 0.0
    count: int = 0


@dataclass
class WindowFigures:
    """What one window measured on this rank."""

    modules: list[ModuleStats]
    phases: dict[str, PhaseTotals]
    recompute_flops: int
    params: int
    wall_seconds: float

    def flops(self, phase: str) -> int:
        return self.phases[phase].flops if phase in self.phases else 0

    def seconds(self, phase: str) -> float:
        return self.phases[phase].seconds if phase in self.phases else 0.0


@dataclass
class _Open:
    name: str
    started: float
    counts: dict[str, int]


@dataclass
class ProfileSession:
    """Counts FLOPs and times modules over one window of ``root``'s execution ([Note: counting without
    monkey-patching]). States: NEW → OPEN (``start``) → CLOSED (``stop``); figures readable once opened."""

    root: nn.Module
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    param_count: ParamCount = full_param_count
    ignore: tuple[type, ...] = ()
    state: str = "NEW"

    def __post_init__(self) -> None:
        self._mode: FlopCounterMode | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._stats: dict[int, ModuleStats] = {}
        self._by_tracker_name: dict[str, ModuleStats] = {}
        self._phases: dict[str, PhaseTotals] = defaultdict(PhaseTotals)
        self._open: _Open | None = None
        self._starts: dict[int, list[float]] = defaultdict(list)
        self._backward_calls: dict[int, list[_BackwardTiming]] = defaultdict(list)
        self._recompute_depth = 0
        self._recompute_from = 0
        self._recompute_flops = 0
        self._wall_start = 0.0
        self._wall_end: float | None = None
        self._index_modules()

    # --- window ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        assert self.state == "NEW", f"a profiling session is started once (state {self.state})"
        warm_up_mode()
        # Recompute is measured as the forward windows run in backward; torch's non-reentrant checkpoint stops a
        # recompute early (once the last needed tensor exists), so the window would never close: for the profiled
        # window only, recompute runs whole (same values, a little more work). [Note: measuring recompute]
        self._no_early_stop = torch.utils.checkpoint.set_checkpoint_early_stop(False)
        self._no_early_stop.__enter__()
        self._mode = FlopCounterMode(display=False, custom_mapping=custom_mapping())
        self._mode.__enter__()
        for stats in self._stats.values():
            if not isinstance(stats.module, self.ignore):
                self._hooks.append(stats.module.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(stats.module.register_forward_hook(self._post_forward))
        self._wall_start = self._now()
        self.state = "OPEN"

    def stop(self) -> None:
        """Close the window (idempotent): the mode exits, the hooks go; the figures stay."""
        if self.state != "OPEN":
            return
        if self._open is not None:
            self.end_phase(self._open.name)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self._no_early_stop.__exit__(None, None, None)
        self._wall_end = self._now()
        self.state = "CLOSED"

    # --- phases ------------------------------------------------------------------------------------------------
    def begin_phase(self, name: str) -> None:
        if self.state != "OPEN" or self._open is not None:
            return  # nested phases are charged to the outer one
        self._open = _Open(name, self._now(), self._counts())

    def end_phase(self, name: str) -> None:
        if self.state != "OPEN" or self._open is None or self._open.name != name:
            return
        opened, self._open = self._open, None
        self._recompute_depth = 0  # a recompute that raised never closed its window
        totals = self._phases[name]
        seconds = self._now() - opened.started
        totals.seconds += seconds
        totals.count += 1
        after = self._counts()
        phase_flops = after.get("Global", 0) - opened.counts.get("Global", 0)
        totals.flops += phase_flops
        root = self._stats[id(self.root)]
        # The root is charged the whole phase: its backward has no tracked end when its inputs need no gradient
        # (token ids), and everything in an engine phase is the root's work anyway.
        if name == "forward":
            root.fwd_flops += phase_flops
        elif name == "backward":
            root.bwd_flops += phase_flops
            root.bwd_latency += seconds
        for tracker_name, value in after.items():
            stats = self._by_tracker_name.get(tracker_name)
            if stats is root:
                continue
            delta = value - opened.counts.get(tracker_name, 0)
            if stats is None or delta == 0:
                continue
            if name == "forward":
                stats.fwd_flops += delta
            elif name == "backward":
                stats.bwd_flops += delta

    @property
    def in_phase(self) -> str | None:
        return self._open.name if self._open is not None else None

    def figures(self) -> WindowFigures:
        assert self.state != "NEW", "no figures before the session started"
        end = self._wall_end if self._wall_end is not None else self._now()
        modules = list(self._stats.values())
        return WindowFigures(
            modules, dict(self._phases), self._recompute_flops, modules[0].params, end - self._wall_start
        )

    # --- internals ---------------------------------------------------------------------------------------------
    def _index_modules(self) -> None:
        # FlopCounterMode's ModuleTracker names the first module it sees by its class and the rest by attribute
        # path below it; the root is what the engine calls, so its names are "<RootClass>.<path>".
        root_name = type(self.root).__name__
        for path, module in self.root.named_modules():
            params = sum(self.param_count(p) for p in module.parameters())  # a tied matrix once
            stats = ModuleStats(path, module, path.count(".") + 1 if path else 0, params)
            self._stats[id(module)] = stats
            self._by_tracker_name[f"{root_name}.{path}" if path else root_name] = stats

    def _counts(self) -> dict[str, int]:
        assert self._mode is not None
        return {name: sum(ops.values()) for name, ops in self._mode.flop_counts.items()}

    def _global(self) -> int:
        assert self._mode is not None
        return sum(self._mode.flop_counts["Global"].values()) if "Global" in self._mode.flop_counts else 0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run asynchronously: time them, not their launch
        return time.perf_counter()

    def _pre_forward(self, module: nn.Module, args: object) -> None:
        if self.in_phase == "backward":  # activation-checkpointing recompute
            if self._recompute_depth == 0:
                self._recompute_from = self._global()
            self._recompute_depth += 1
            return
        if self.in_phase == "forward" and module is not self.root:  # the root's backward is the phase's
            timing = _BackwardTiming(self, self._stats[id(module)])
            self._backward_calls[id(module)].append(timing)
            inputs = _grad_tensors(args)
            if inputs:
                self._hooks.append(register_multi_grad_hook(inputs, timing.end))
        if self.in_phase == "forward":
            self._starts[id(module)].append(self._now())

    def _post_forward(self, module: nn.Module, args: object, output: object) -> None:
        if self.in_phase == "backward":
            if self._recompute_depth > 0:
                self._recompute_depth -= 1
                if self._recompute_depth == 0:
                    self._recompute_flops += self._global() - self._recompute_from
            return
        starts = self._starts.get(id(module))
        if self.in_phase == "forward" and starts:
            self._stats[id(module)].fwd_latency += self._now() - starts.pop()
            calls = self._backward_calls.get(id(module))
            outputs = _grad_tensors(output)
            if calls and outputs:
                self._hooks.append(register_multi_grad_hook(outputs, calls.pop().start, mode="any"))


def _grad_tensors(value: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class _BackwardTiming:
    """One module call's backward, timed by gradient hooks (the ``ModuleTracker`` way): it starts when a gradient
    first reaches the call's outputs and ends when every gradient of its inputs is computed."""

    def __init__(self, session: ProfileSession, stats: ModuleStats) -> None:
        self.session = session
        self.stats = stats
        self.started: float | None = None

    def start(self, *grads: object) -> None:
        if self.started is None and self.session.in_phase == "backward":
            self.started = self.session._now()

    def end(self, *grads: object) -> None:
        if self.started is not None and self.session.in_phase == "backward":
            self.stats.bwd_latency += self.session._now() - self.started
        self.started = None
