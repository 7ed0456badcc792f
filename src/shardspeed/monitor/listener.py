"""``MonitorListener``: the ``EngineListener`` that turns each finished optimizer step into events.

[Note: when a step is written] A ``StepReport`` arrives inside the ``step`` phase (training/micro_driver.py), before the
phase timer stops, so the listener keeps it and writes when the ``step`` phase ends — after ``PhaseTimers`` (subscribed
earlier) has closed the step and published ``last_step``. The throughput window runs from the first phase of the step
(its first training forward; under a pipeline the ``batch`` phase, entered with ``train_batch``, so the writer's wait
for the pipeline to fill counts, as DeepSpeed's timer started in ``train_batch``) to the end of its ``step`` phase: time
the script spends between steps (data loading) is not counted. The listener's own cost is outside the window and is
summed in ``seconds_inside`` (the monitor benchmark divides it by the step time).

[Note: one gather per step] The per-rank memory figures (and the tokens per sample each rank saw) travel in one small
int64 all-gather over the world per step, tagged ``monitor.memory``, issued on *every* rank (never only on the writer,
which would hang) whenever the config enables a monitor ([Note: monitor config agreed] in master.py: the same on every
rank; ``add`` never starts it). It goes through the engine's ``Collectives``, so it is logged and interruptible like
every other collective; its tag keeps it apart from the data-parallel traffic figures (nothing sums it into ZeRO's
traffic). It is launched asynchronously after step k and waited after step k+1 (or in ``engine.destroy()``), so neither
its latency nor the ranks' skew lands on the training thread (waiting for it synchronously cost ~4 ms a step at 2 gloo
ranks on the benchmark); its events keep step k's x, and reach the monitors one step later. ``engine.destroy()`` waits
for the last one, unless a failure is known (a failed peer never joins it): those figures are then lost. Per rank it
carries the host and device peaks, the memory model's prediction (``engine.predicted_memory.total()``, the startup
line's "model states per rank (predicted)"), the model-state bytes really held (``engine.memory_breakdown()``) and the
tokens per sample.

[Note: tokens per sample] ``tokens_per_second`` = samples/s × tokens per sample. The engine learns the tokens per sample
from the shape of the model's first positional input (or ``input_ids=``) when it is an integer (B, S) tensor: S (padding
included; the last training forward's S, so a fixed sequence length is assumed). The engine's ``forward`` (and the
pipeline's first stage) announce their inputs (``EngineEvents.inputs``): no hook is put on the user's module, so
``copy.deepcopy`` / pickling ``engine.module`` is unaffected. Under a pipeline only the first stage sees token ids; the
figure travels to the writer in the per-step gather (the largest S any rank saw). ``engine.monitor.tokens_per_sample =
N`` overrides it (e.g. for packed or variable-length batches).
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
from .tags import RankMemory, difficulty_events, step_events

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
    """Subscribed to ``engine.events`` by ``attach_monitor``; writes only while some monitor is on."""

    def __init__(self, engine: Any, master: MonitorMaster) -> None:
        self._engine = weakref.ref(engine)  # the engine owns this listener (through its events)
        self.master = master
        self.seconds_inside = 0.0
        """Wall time spent inside this listener (events built, memory gathered, monitors written)."""
        self.steps_written = 0
        self.seen_tokens: int | None = None
        self._pending: StepReport | None = None
        self._window_start: float | None = None
        self._unsubscribe: Any = None
        self._inflight: Any = None  # (work, sent, received, x, ranks) of the gather launched at the last step
        self._tokens: int | None = None  # the largest tokens per sample any rank saw, from the last gather

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def attach(self) -> None:
        self._unsubscribe = self._engine().events.subscribe(self)

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # --- EngineListener ---------------------------------------------------------------------------------------------
    def on_inputs(self, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        """A training forward's inputs ([Note: tokens per sample])."""
        seen = tokens_per_sample_of(*inputs)
        if seen is not None:
            self.seen_tokens = seen

    def on_phase_start(self, phase: str) -> None:
        # the pipeline's train_batch ("batch") opens the window; an evaluation forward (under no_grad: engine(x) in
        # eval, the pipeline's eval_batch) between two training steps does not start the next step's window
        opens = self._window_start is None and (phase != "forward" or torch.is_grad_enabled())
        if phase == "batch" or opens:
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
        gathers = self.master.configured  # the same on every rank: [Note: one gather per step]
        if engine is None or not (gathers or self.master.enabled):
            return
        began = time.perf_counter()
        memory: list[Event] = []
        if gathers:
            memory = self._collect()  # the last step's gather, launched one step ago
            self._launch(engine, report.global_samples)  # this step's, on every rank
        elif self.master.enabled:  # only added monitors: no gather, this rank's own figures ([Note: added ...])
            memory = _rank_events([engine.topology.global_rank], [self._figures(engine)], report.global_samples)
        if self.master.enabled:
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
            sampler = getattr(engine.training_dataloader, "sampler", None)  # data/difficulty_sampler.py
            events += difficulty_events(getattr(sampler, "current_difficulties", None), report.global_samples)
            self.master.write_events(events + memory)
            self.steps_written += 1
        self.seconds_inside += time.perf_counter() - began

    def finish(self, wait: bool = True) -> None:
        """``engine.destroy()`` (every rank): wait for the last step's gather and write its memory figures;
        ``wait=False`` (a failure is known): drop it unwaited."""
        if not wait:
            self._inflight = None
            return
        events = self._collect()
        if self.master.enabled:
            self.master.write_events(events)

    def _figures(self, engine: Any) -> list[int]:
        device_peak = device_peak_bytes(engine.device)
        return [
            host_peak_bytes(),
            -1 if device_peak is None else device_peak,
            int(engine.predicted_memory.total()),
            model_state_total(engine.memory_breakdown()),
            self.seen_tokens or 0,
        ]

    def _launch(self, engine: Any, x: int) -> None:
        """Start the all-gather of this rank's figures over the world (asynchronous: waited at the next step)."""
        world = engine.topology.world
        mine = torch.tensor(self._figures(engine), dtype=torch.int64, device=engine.device)
        gathered = torch.empty(world.size * mine.numel(), dtype=torch.int64, device=engine.device)
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
        self._tokens = max(row[-1] for row in rows) or None
        return _rank_events(ranks, rows, x)


def _rank_events(ranks: Any, rows: list[list[int]], x: int) -> list[Event]:
    """``Memory/rank{r}/*`` events from each rank's figures (``MonitorListener._figures``)."""
    memory = [
        RankMemory(rank, host, None if device < 0 else device, predicted, held)
        for rank, (host, device, predicted, held, _) in zip(ranks, rows, strict=True)
    ]
    return [event for rank in memory for event in rank.events(x)]


def _mfu(engine: Any, samples_per_second: float | None) -> float | None:
    """S5: ``model_flops_utilization`` from the flops profiler's figure, once it has one."""
    profiler = getattr(engine, "flops_profiler", None)
    per_sample = getattr(profiler, "model_flops_per_sample", None)
    if per_sample is None or not samples_per_second:
        return None
    from shardspeed.profiling import mfu  # read at call time (tests replace the function)

    return mfu.model_flops_utilization(per_sample, samples_per_second, engine.topology.world.size, profiler.peak_flops)


def attach_monitor(engine: Any) -> MonitorMaster:
    """``engine.monitor``: the configured monitors, and the step listener subscribed to ``engine.events``. The
    engine called ``agree_monitor_config`` at its start."""
    master = MonitorMaster.from_config(engine.config, engine.topology)
    master.listener = MonitorListener(engine, master)
    master.listener.attach()
    return master
