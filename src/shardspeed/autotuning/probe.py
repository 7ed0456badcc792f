"""The engine side of an autotuning trial: an ``EngineListener`` (training/events.py) that measures the profile
window, appends per-step progress records, writes the metric JSON and ends the process.

Active only when the trial's config says ``autotuning.enabled`` (the tuner writes it into each trial's config,
with ``metric_path`` and ``progress_path``; DeepSpeed's engine does the same with its config's section).

[Note: the trial's exit] DeepSpeed's engine calls ``exit()`` on every rank once ``global_steps`` passes
``end_profile_step``. Here every rank hears ``on_step`` for the same step (steps are agreed world-wide), gathers the
ranks' peak memory (one ``all_gather_object`` over the world, through ``Collectives``: every rank calls it at the
same step, so it cannot hang), rank 0 writes the metric JSON (atomically: write, then rename, so the runner never
reads half a file), and every rank raises ``AutotuningExit`` — a ``SystemExit`` with status 0, marked *agreed* so
the failure guard neither publishes it nor fails the engine. An unmodified training script therefore ends with
status 0 and no traceback right after the measured window, on every rank.

Model-info profile (DeepSpeed's ``model_info.profile``): the first training forward runs under a
``SavedTensorCounter`` (activation.py); after ``PROFILE_STEPS`` steps rank 0 writes ``model_info_path`` (parameter
counts, saved activation bytes of one micro-batch, peak memory over those steps) and every rank exits the same way.

Accounted memory ([Note: accounted memory]): on CPU a trial's peak RSS is mostly the runtime's own (~350 MB of
interpreter and torch), so comparing a prediction with it says little about the model's part. Each rank therefore
also reports the memory the model accounts for, measured from the tensors themselves: the engine's model states
as allocated (``engine.memory_breakdown()``, transient buckets aside) and the largest saved-tensor bytes of one
training forward (``SavedTensorCounter``) over the forwards before the measured window (counting stays out of the
timed steps). The tuner compares its prediction (model states + activations, no fitted offset) with that figure.

Measured window: from the end of step ``start_profile_step`` to the end of step ``end_profile_step``; latency is
the median of the window's step times (seconds per optimizer step; the mean, DeepSpeed's figure, is kept as
``mean_latency``), throughput the samples of one step (the whole data-parallel group's) over that median, flops
the model FLOPs per second per rank from the flops profiler (the trial's config enables it on an earlier step).
[Note: median step time] A trial's window is a few seconds at most, and on a shared host one descheduled step
moves its mean by tens of percent (the demo's tune on 2 cores: the same config measured 80 and 101 samples/s);
the median of the steps ignores such a step, so the tuner ranks configurations, not interruptions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from shardspeed.autotuning.activation import SavedTensorCounter
from shardspeed.config.autotuning import AutotuningConfig
from shardspeed.faults.errors import mark_agreed
from shardspeed.monitor.memory import device_peak_bytes, host_peak_bytes
from shardspeed.training.events import StepReport

__all__ = ["AutotuningExit", "AutotuningProbe", "attach_autotuning_probe", "loss_fields", "metric_record"]

DEFAULT_METRIC_FILE = "autotuning_metric.json"  # DeepSpeed's default names, in the working directory
DEFAULT_MODEL_INFO_FILE = "autotuning_model_info.json"
PROGRESS_FILE = "progress.jsonl"
PROFILE_STEPS = 3
"""Steps of a model-info profile: its peak memory is over these (the first step's alone misses what the allocator
keeps from step to step: on CPU the demo's checkpointed trials peaked ~2x above a one-step profile's slope)."""


class AutotuningExit(SystemExit):
    """Raised on every rank after the measured window ([Note: the trial's exit]); status 0."""


def metric_record(
    *,
    latency_s: float,
    samples_per_s: float,
    mean_latency_s: float | None = None,
    world_size: int,
    flops_per_sample: float | None,
    memory: list[dict[str, int | None]],  # per rank; model_state_bytes / activation_bytes: accounted
    predicted_memory: dict[str, int],
    window_steps: int,
) -> dict[str, Any]:
    """The metric JSON (pure): DeepSpeed's ``latency`` / ``throughput`` / ``FLOPS_per_gpu`` plus the memory each rank
    peaked at (``host_peak_bytes``: VmHWM; ``device_peak_bytes``: CUDA max allocated or None) and the engine's own
    model-state prediction."""
    flops = flops_per_sample * samples_per_s / world_size if flops_per_sample else None
    accounted = [m for m in memory if m.get("model_state_bytes") is not None]
    return {
        "latency": latency_s,
        "throughput": samples_per_s,
        "mean_latency": latency_s if mean_latency_s is None else mean_latency_s,
        "flops": flops,
        "FLOPS_per_gpu": flops,
        "window_steps": window_steps,
        "world_size": world_size,
        "memory": memory,
        "max_host_peak_bytes": max(int(m["host_peak_bytes"] or 0) for m in memory),
        "max_device_peak_bytes": max((int(m["device_peak_bytes"] or 0) for m in memory), default=0) or None,
        "max_accounted_bytes": max(
            (int(m["model_state_bytes"] or 0) + int(m.get("activation_bytes") or 0) for m in accounted), default=None
        ),
        "predicted_model_states": predicted_memory,
    }


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class AutotuningProbe:
    """Inactive unless ``autotuning.enabled``. See the module docstring."""

    def __init__(self, config: AutotuningConfig, engine: Any) -> None:
        self.config = config
        self.enabled = config.enabled
        self._owner = weakref.ref(engine)  # no cycle through the listener: dropping the engine frees it
        metric = Path(config.metric_path or DEFAULT_METRIC_FILE)
        self.metric_path = metric
        self.progress_path = Path(config.progress_path) if config.progress_path else metric.with_name(PROGRESS_FILE)
        self._last = (time.perf_counter(), 0)
        self._window_start: tuple[float, int] | None = None
        self._step_seconds: list[float] = []  # each step's wall time inside the window
        self.profiling = bool(config.enabled and config.model_info and config.model_info.get("profile"))
        self.model_info_path = Path(config.model_info_path or DEFAULT_MODEL_INFO_FILE)
        self._counter: SavedTensorCounter | None = None
        self._counting = contextlib.ExitStack()
        self._accounting: SavedTensorCounter | None = None  # the forward being counted ([Note: accounted memory])
        self.activation_peak = 0

    # --- the model-info profile: saved tensors of the first training forward ---------------------------------------
    def on_phase_start(self, phase: str) -> None:
        engine = self._owner()
        if phase != "forward" or engine is None or not (engine.module.training and torch.is_grad_enabled()):
            return
        if self.profiling and self._counter is None:
            self._counter = SavedTensorCounter(engine.module.parameters())
            self._counting.enter_context(self._counter.counting())
        elif self.enabled and not self.profiling and engine.global_steps < self.config.start_profile_step:
            self._accounting = SavedTensorCounter(engine.module.parameters())
            self._counting.enter_context(self._accounting.counting())

    def on_phase_end(self, phase: str) -> None:
        if phase == "forward":
            self._counting.close()
            if self._accounting is not None:
                self.activation_peak = max(self.activation_peak, self._accounting.bytes)
                self._accounting = None

    def _write_model_info(self, engine: Any) -> None:
        params = list(engine.module.parameters())
        counter = self._counter
        info = {
            "num_params": sum(p.numel() for p in params),
            "trainable_num_params": sum(p.numel() for p in params if p.requires_grad),
            "activation_bytes": counter.bytes if counter else 0,
            "saved_tensors": counter.tensors if counter else 0,
            "micro_batch": engine.config.train_micro_batch_size_per_gpu,
            "host_peak_bytes": host_peak_bytes(),
            "device_peak_bytes": device_peak_bytes(engine.device),
        }
        if engine.topology.global_rank == 0:
            _write_atomic(self.model_info_path, json.dumps(info, indent=2))
        self.enabled = False
        raise mark_agreed(AutotuningExit(0))

    def on_step(self, report: StepReport) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        engine = self._owner()
        assert engine is not None
        rank = engine.topology.global_rank
        then, samples_then = self._last
        self._last = (now, report.global_samples)
        if rank == 0:
            rate = (report.global_samples - samples_then) / max(now - then, 1e-9)
            record = {"step": report.global_step, **loss_fields(report.loss), "samples_per_s": rate}
            self.progress_path.parent.mkdir(parents=True, exist_ok=True)
            with self.progress_path.open("a") as out:  # one line per step, flushed: the runner tails it
                out.write(json.dumps(record) + "\n")
        if self.profiling and report.global_step >= PROFILE_STEPS:
            self._write_model_info(engine)
        if self._window_start is not None:
            self._step_seconds.append(now - then)
        if report.global_step == self.config.start_profile_step:
            self._window_start = (now, report.global_samples)
        if report.global_step >= self.config.end_profile_step and self._window_start is not None:
            self._finish(engine, now, report.global_samples)

    def _finish(self, engine: Any, now: float, samples: int) -> None:
        assert self._window_start is not None
        t0, s0 = self._window_start
        steps = self.config.end_profile_step - self.config.start_profile_step
        mine = {
            "rank": engine.topology.global_rank,
            "host_peak_bytes": host_peak_bytes(),
            "device_peak_bytes": device_peak_bytes(engine.device),
            "model_state_bytes": _state_bytes(engine),
            "activation_bytes": self.activation_peak,
        }
        memory = engine.collectives.all_gather_object(mine, engine.topology.world)  # every rank, same step
        profiler = getattr(engine, "flops_profiler", None)
        predicted = engine.predicted_memory
        latency = statistics.median(self._step_seconds) if self._step_seconds else (now - t0) / steps
        record = metric_record(
            latency_s=latency,
            samples_per_s=(samples - s0) / steps / max(latency, 1e-9),
            mean_latency_s=(now - t0) / steps,
            world_size=engine.topology.world.size,
            flops_per_sample=getattr(profiler, "model_flops_per_sample", None),
            memory=list(memory),  # type: ignore[arg-type]
            predicted_memory={
                "params": predicted.params,
                "grads": predicted.grads,
                "optimizer": predicted.optimizer,
                "cpu": predicted.cpu,
            },
            window_steps=steps,
        )
        if engine.topology.global_rank == 0:
            _write_atomic(self.metric_path, json.dumps(record, indent=2))
            engine.logger.info("autotuning: wrote %s; exiting after step %d", self.metric_path, engine.global_steps)
        self.enabled = False
        raise mark_agreed(AutotuningExit(0))


def _state_bytes(engine: Any) -> int:
    """The model states this rank allocated (``memory_breakdown``), transient buckets aside."""
    return sum(v for k, v in engine.memory_breakdown().items() if k != "peak_bucket_bytes")


def loss_fields(loss: Any) -> dict[str, Any]:
    """A progress record's loss fields: ``{"loss": x}``, nothing when backward saw no loss, and for a NaN/Inf loss
    ``{"loss": null, "loss_finite": false}`` (NaN is not JSON): a reader sees a null loss *with its key* as
    diverged (``hpo/progress.py``), never as a missing value."""
    if loss is None:
        return {}
    value = float(loss)
    if math.isfinite(value):
        return {"loss": value}
    return {"loss": None, "loss_finite": False}


def attach_autotuning_probe(engine: Any) -> AutotuningProbe:
    """Build the probe and subscribe it to ``engine.events`` (call once ``engine.progress`` exists)."""
    probe = AutotuningProbe(engine.config.autotuning, engine)
    engine.events.subscribe(probe)
    return probe
