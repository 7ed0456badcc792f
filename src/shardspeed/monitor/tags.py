"""The events one finished optimizer step produces, as a pure function of what the listener measured.

DeepSpeed's tags (``Train/Samples/...``, x = global samples) and ours: listed in ``step_events``'s docstring and
in the README's "Monitoring" section.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardspeed.training.events import StepReport

from .base import Event

__all__ = ["DIFFICULTY", "TRAIN", "RankMemory", "difficulty_events", "step_events"]

TRAIN = "Train/Samples/"
DIFFICULTY = TRAIN + "data_sampling_difficulty/"
"""Per-metric difficulty of the difficulty-aware sampler (data_efficiency; shardspeed's tag, DeepSpeed logs none)."""


def difficulty_events(difficulties: Mapping[str, int] | None, x: int) -> list[Event]:
    """``Train/Samples/data_sampling_difficulty/<metric>``: the difficulty each metric had for the last global
    batch (nothing without the difficulty sampler)."""
    return [(DIFFICULTY + name, float(value), x) for name, value in sorted((difficulties or {}).items())]


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory figures (gathered to the writing rank)."""

    rank: int
    host_peak_bytes: int
    device_peak_bytes: int | None
    predicted_model_state_bytes: int
    """The memory model's prediction (``engine.predicted_memory.total()``)."""
    model_state_bytes: int
    """The model-state bytes the engine holds (``engine.memory_breakdown()``, transient buckets excluded)."""

    def events(self, x: int) -> list[Event]:
        prefix = f"Memory/rank{self.rank}/"
        out: list[Event] = [(prefix + "host_peak_bytes", float(self.host_peak_bytes), x)]
        if self.device_peak_bytes is not None:
            out.append((prefix + "device_peak_bytes", float(self.device_peak_bytes), x))
        out.append((prefix + "predicted_model_state_bytes", float(self.predicted_model_state_bytes), x))
        out.append((prefix + "model_state_bytes", float(self.model_state_bytes), x))
        return out


def step_events(
    report: StepReport,
    *,
    skipped_steps: int,
    samples_per_second: float | None = None,
    tokens_per_sample: int | None = None,
    phase_seconds: Mapping[str, float] | None = None,
    mfu: float | None = None,
    memory: Sequence[RankMemory] = (),
) -> list[Event]:
    """Every event of one step, x = ``report.global_samples``:

    - ``train_loss`` (the report's loss), ``lr`` (group 0) and ``lr_group{i}`` (i >= 1), ``loss_scale`` (fp16);
    - ``elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step,offload_io}`` from
      ``phase_seconds`` (``wall_clock_breakdown``; ms per optimizer step, micro-steps summed);
    - ``samples_per_second``, ``tokens_per_second`` (with ``tokens_per_sample``), ``grad_norm`` (when the step
      computed it), ``skipped_steps`` (cumulative), ``mfu`` (a fraction);
    - ``Memory/rank{r}/...`` for each ``memory`` entry.
    """
    x = report.global_samples
    out: list[Event] = []
    if report.loss is not None:
        out.append((TRAIN + "train_loss", float(report.loss), x))
    for i, lr in enumerate(report.lr):
        out.append((TRAIN + ("lr" if i == 0 else f"lr_group{i}"), float(lr), x))
    if report.loss_scale is not None:
        out.append((TRAIN + "loss_scale", float(report.loss_scale), x))
    for name, seconds in (phase_seconds or {}).items():
        out.append((TRAIN + f"elapsed_time_ms_{name}", 1000.0 * seconds, x))
    if samples_per_second is not None:
        out.append((TRAIN + "samples_per_second", samples_per_second, x))
        if tokens_per_sample:
            out.append((TRAIN + "tokens_per_second", samples_per_second * tokens_per_sample, x))
    if report.grad_norm is not None:
        out.append((TRAIN + "grad_norm", float(report.grad_norm), x))
    out.append((TRAIN + "skipped_steps", float(skipped_steps), x))
    if mfu is not None:
        out.append((TRAIN + "mfu", mfu, x))
    for rank in memory:
        out.extend(rank.events(x))
    return out
