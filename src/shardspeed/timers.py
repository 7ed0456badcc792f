"""``wall_clock_breakdown``: time spent in forward, backward and step, summed between log lines and per step.

Off by default: timing a CUDA step needs a device synchronisation at each phase boundary (``torch.cuda.synchronize``
at every start and end, so the kernels a phase queued are counted in that phase), which costs throughput.

[Note: backward split] DeepSpeed splits backward into ``backward_inner`` (the autograd pass) and
``backward_allreduce`` (the gradient reduction it runs after it). Here the reductions overlap the autograd pass
(buckets launch from gradient hooks), so there is no separate reduction phase to time; what the step pays for
communication is the time the training thread sat blocked in a wait. ``backward_allreduce`` is therefore the
growth of the engine's ``BlockedTime`` (comm/blocked.py: every real ``Work.wait()`` and synchronous collective)
while the backward phase ran — reductions, and ZeRO-3's parameter gathers, whatever the training thread waited on
— and ``backward_inner = backward - backward_allreduce``. The two add up to ``backward`` by construction.
``offload_io`` is the time the offloaded optimizer's step was blocked on its store's reads and writes
(``StreamedAdam.timings``: offload/stream.py), measured across the step phase; absent without a streamed optimizer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from shardspeed.comm.blocked import BlockedTime

__all__ = ["PHASE_ORDER", "PhaseTimers", "offload_io_clock"]

PHASE_ORDER: tuple[str, ...] = ("forward", "backward", "backward_inner", "backward_allreduce", "step", "offload_io")
"""The timed quantities, in the order reports list them."""


def offload_io_clock(optimizer: Any) -> Callable[[], float] | None:
    """Seconds the offloaded optimizer has been blocked on its store so far, or None for an in-memory optimizer."""
    if getattr(optimizer, "timings", None) is None or not hasattr(optimizer.timings, "wait_read_s"):
        return None
    return lambda: optimizer.timings.wait_read_s + optimizer.timings.wait_write_s


class PhaseTimers:
    """An ``EngineListener`` (training/events.py): the loop announces phases, the timers measure them.

    ``totals``: seconds per quantity since the last ``report_and_reset`` (the progress line). ``last_step``:
    seconds per quantity of the last finished optimizer step (its micro-steps summed), set when its ``step``
    phase ends (what the monitors write as ``Train/Samples/elapsed_time_ms_*``)."""

    def __init__(
        self, enabled: bool, device: torch.device, blocked: BlockedTime | None = None, optimizer: Any = None
    ) -> None:
        self.enabled = enabled
        self.device = device
        self.blocked = blocked
        self.io_clock = offload_io_clock(optimizer)
        self.totals: dict[str, float] = defaultdict(float)
        self.last_step: dict[str, float] = {}
        self._this_step: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}
        self._blocked_at = 0.0
        self._io_at = 0.0

    def on_phase_start(self, phase: str) -> None:
        if not self.enabled:
            return
        self._sync()
        if phase == "backward" and self.blocked is not None:
            self._blocked_at = self.blocked.total()
        if phase == "step" and self.io_clock is not None:
            self._io_at = self.io_clock()
        self._started[phase] = time.perf_counter()

    def on_phase_end(self, phase: str) -> None:
        if not self.enabled or phase not in self._started:
            return
        self._sync()
        elapsed = time.perf_counter() - self._started.pop(phase)
        self._add(phase, elapsed)
        if phase == "backward":
            # [Note: backward split]; clamped: a benchmark may reset the meter while a backward runs
            waited = self.blocked.total() - self._blocked_at if self.blocked is not None else 0.0
            waited = min(max(waited, 0.0), elapsed)
            self._add("backward_allreduce", waited)
            self._add("backward_inner", elapsed - waited)
        if phase == "step":
            if self.io_clock is not None:
                self._add("offload_io", max(self.io_clock() - self._io_at, 0.0))
            self.last_step = dict(self._this_step)
            self._this_step.clear()

    def _add(self, name: str, seconds: float) -> None:
        self.totals[name] += seconds
        self._this_step[name] += seconds

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def report_and_reset(self, steps: int) -> str:
        """'forward 12.1 ms, backward 30.2 ms, backward_inner 25.0 ms, ... per step' since the last report."""
        names = [n for n in PHASE_ORDER if n in self.totals] + [n for n in self.totals if n not in PHASE_ORDER]
        parts = [f"{name} {1000 * self.totals[name] / max(steps, 1):.1f} ms" for name in names]
        self.totals.clear()
        return ", ".join(parts) + " per step"
