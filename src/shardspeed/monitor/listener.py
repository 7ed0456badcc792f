"""``MonitorListener``: the ``EngineListener`` that turns each finished optimizer step into events.

[Note: when a step is written] A ``StepReport`` arrives inside the ``step`` phase (training/micro_driver.py), before
the phase timer stops, so the listener keeps it and writes when the ``step`` phase ends — after ``PhaseTimers``
(subscribed earlier) has closed the step and published ``last_step``. The throughput window runs from the first
phase of the step (its first forward) to the end of its ``step`` phase, like DeepSpeed's throughput timer: time the
script spends between steps (data loading) is not counted. The listener's own cost is outside the window and is
summed in ``seconds_inside`` (the monitor benchmark divides it by the step time).

[Note: one gather per step] The per-rank memory figures (and the tokens per sample each rank saw) travel in one
small int64 all-gather over the world per step, tagged ``monitor.memory``, issued on *every* rank (never only on
the writer, which would hang) whenever the monitors are active (the config enables one, or ``add`` was called on
every rank). It goes through the engine's ``Collectives``, so it is logged and interruptible like every other
collective; its tag keeps it apart from the data-parallel traffic figures (nothing sums it into ZeRO's traffic).
It is launched asynchronously after step k and waited after step k+1 (or in ``engine.destroy()``), so neither its
latency nor the ranks' skew lands on the training thread (waiting for it synchronously cost ~4 ms a step at 2 gloo
ranks on the benchmark); its events keep step k's x, and reach the monitors one step later.

[Note: tokens per sample] ``tokens_per_second`` = samples/s × tokens per sample. The engine learns the tokens per
sample from the shape of the model's first positional input (or ``input_ids=``) when it is an integer (B, S)
tensor: S (padding included; the last forward's S, so a fixed sequence length is assumed). Under a pipeline only the
first stage sees token ids; the figure travels to the writer in the per-step gather (the largest S any rank saw).
``engine.monitor.tokens_per_sample = N`` overrides it (e.g. for packed or variable-length batches).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from shardspeed.training.events import StepReport

from .base import Event
from .master import MonitorMaster
from .memory import device_peak_bytes, host_peak_bytes, model_state_total
from .tags import RankMemory, step_events

__all__ = ["MonitorListener", "attach_monitor", "tokens_per_sample_of"]

GATHER_TAG = "monitor.memory"


def tokens_per_sample_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """[Note: tokens per sample]: S of an integer (B, S) first input (or ``input_ids``), else None."""
    first = args[0] if args else kwargs.get("input_ids")
    if isinstance(first, (tuple, list)) and first:  # a pipeline stage's inputs come as one tuple
        first = first[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 2:
        return None
    if first.is_floating_point() or first.is_complex() or first.dtype == torch.bool:
        return None
    return int(first.shape[1])


class MonitorListener:
    """Subscribed to ``engine.events`` by ``attach_monitor``; does nothing while the master is not active."""

    def __init__(self, engine: Any, master: MonitorMaster) -> None:
        self._engine = weakref.ref(engine)  # the engine owns this listener (through its events)
        self.master = master
        self.seconds_inside = 0.0
        """Wall time spent inside this listener (events built, memory gathered, monitors written)."""
        self.steps_written = 0
        self.seen_tokens: int | None = None
        self._pending: StepReport | None = None
        self._window_start: float | None = None
        self._hook: Any = None
        self._unsubscribe: Any = None
        self._inflight: Any = None  # (work, sent, received, x, ranks) of the gather launched at the last step
        self._tokens: int | None = None  # the largest tokens per sample any rank saw, from the last gather

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def attach(self) -> None:
        engine = self._engine()
        self._unsubscribe = engine.events.subscribe(self)
        if self.master.active:
            self.activate()

    def activate(self) -> None:
        """The monitors became active: watch inputs for the tokens per sample, compute the norm every step."""
        engine = self._engine()
        if self._hook is None and engine is not None:
            self._hook = engine.module.register_forward_pre_hook(self._see_inputs, with_kwargs=True)
            driver = getattr(engine, "_driver", None)
            if driver is not None:
                driver.norm_every_step = True  # grad_norm every step (symmetric: active is the same everywhere)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _see_inputs(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen = tokens_per_sample_of(args, kwargs)
        if seen is not None:
            self.seen_tokens = seen

    # --- EngineListener ---------------------------------------------------------------------------------------------
    def on_phase_start(self, phase: str) -> None:
        # an evaluation forward (under no_grad: engine(x) in eval, the pipeline's eval_batch) between two training
        # steps does not start the next step's throughput window
        if self._window_start is None and (phase != "forward" or torch.is_grad_enabled()):
            self._window_start = time.perf_counter()

    def on_step(self, report: StepReport) -> None:
        if self._pending is not None:  # a step whose phase never ended (not expected): written now
            self._write(self._pending, time.perf_counter())
        self._pending = report

    def on_phase_end(self, phase: str) -> None:
        if phase == "step" and self._pending is not None:
            report, self._pending = self._pending, None
            self._write(report, time.perf_counter())

    # --- one step ---------------------------------------------------------------------------------------------------
    def _write(self, report: StepReport, now: float) -> None:
        window, self._window_start = (now - self._window_start if self._window_start is not None else None), None
        engine = self._engine()
        if not self.master.active or engine is None:
            return
        began = time.perf_counter()
        previous = self._collect()  # the last step's gather, launched one step ago: [Note: one gather per step]
        self._launch(engine, report.global_samples)  # this step's, on every rank
        if self.master.writes:
            rate = engine._driver.train_batch_size / window if window else None  # set_train_batch_size changes it
            override = self.master.tokens_per_sample
            events = step_events(
                report,
                skipped_steps=engine.progress.skipped_steps,
                samples_per_second=rate,
                tokens_per_sample=override if override is not None else (self._tokens or self.seen_tokens),
                phase_seconds=engine.timers.last_step if engine.timers.enabled else None,
                mfu=_mfu(engine, rate),
            )
            self.master.write_events(events + previous)
            self.steps_written += 1
        self.seconds_inside += time.perf_counter() - began

    def finish(self) -> None:
        """``engine.destroy()`` (every rank): wait for the last step's gather and write its memory figures."""
        events = self._collect()
        if self.master.writes:
            self.master.write_events(events)

    def _launch(self, engine: Any, x: int) -> None:
        """Start the all-gather of this rank's figures over the world (asynchronous: waited at the next step)."""
        device_peak = device_peak_bytes(engine.device)
        figures = [
            host_peak_bytes(),
            -1 if device_peak is None else device_peak,
            model_state_total(engine.memory_breakdown()),
            self.seen_tokens or 0,
        ]
        world = engine.topology.world
        mine = torch.tensor(figures, dtype=torch.int64, device=engine.device)
        gathered = torch.empty(world.size * len(figures), dtype=torch.int64, device=engine.device)
        work = engine.collectives.all_gather(gathered, mine, world, async_op=True, tag=GATHER_TAG)
        self._inflight = (work, mine, gathered, x, world.ranks)

    def _collect(self) -> list[Event]:
        """Wait for the gather in flight (if any); its memory events (at the x it was taken), and the tokens per
        sample any rank saw."""
        if self._inflight is None:
            return []
        work, _, gathered, x, ranks = self._inflight
        self._inflight = None
        work.wait()
        rows = gathered.view(len(ranks), -1).tolist()
        self._tokens = max(row[3] for row in rows) or None
        memory = [
            RankMemory(ranks[i], host, None if device < 0 else device, predicted)
            for i, (host, device, predicted, _) in enumerate(rows)
        ]
        return [event for rank in memory for event in rank.events(x)]


def _mfu(engine: Any, samples_per_second: float | None) -> float | None:
    """S5: ``model_flops_utilization`` from the flops profiler's figure, once it has one (helper F's module)."""
    profiler = getattr(engine, "flops_profiler", None)
    per_sample = getattr(profiler, "model_flops_per_sample", None)
    if per_sample is None or not samples_per_second:
        return None
    try:
        from shardspeed.profiling.mfu import model_flops_utilization
    except ImportError:  # the profiler's branch is not merged
        return None
    return model_flops_utilization(per_sample, samples_per_second, engine.topology.world.size, profiler.peak_flops)


def attach_monitor(engine: Any) -> MonitorMaster:
    """``engine.monitor``: the configured monitors, and the step listener subscribed to ``engine.events``. The
    engine called ``agree_monitor_packages`` at its start."""
    master = MonitorMaster.from_config(engine.config, engine.topology, engine.collectives, packages_agreed=True)
    master.listener = MonitorListener(engine, master)
    master.listener.attach()
    return master
