"""From a running trial's progress records to Optuna: intermediate values, the prune decision, the objective.

Pure apart from the ``optuna.Trial`` it reports to (tests pass a stub). The engine appends one record per step
(``{"step": s, "loss": x, ...}``); the tracker reports ``record[metric]`` at ``step`` and asks the pruner. A
non-finite value means the run diverged: the trial is stopped and pruned at once (nothing later can rescue it,
and a diverged lr is information the sampler keeps — TPE reads a pruned trial's last reported value).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from shardspeed.autotuning.hpo.launch import StopTrial

DIVERGED_VALUE = 1e30
"""Reported in place of a NaN/Inf loss: Optuna refuses NaN intermediate values; a huge finite value ranks it last
(``-DIVERGED_VALUE`` when the study maximizes: ``diverged_value``)."""


def diverged_value(direction: str) -> float:
    """The intermediate value of a diverged step: the worst value in the study's direction."""
    return -DIVERGED_VALUE if direction == "maximize" else DIVERGED_VALUE


def record_value(record: Mapping[str, Any], metric: str) -> float | None:
    """``record[metric]`` as a float; NaN when the run diverged there; None when the record has no value.

    The engine writes a NaN/Inf loss as ``null`` with ``"<metric>_finite": false`` (NaN is not JSON,
    ``probe.loss_fields``), and leaves the key out when it has no loss: so a null *with its key*, or the flag, is
    divergence, and only a missing key (or a non-number) is "no value"."""
    if record.get(f"{metric}_finite") is False:
        return math.nan
    if metric not in record:
        return None
    value = record[metric]
    if value is None:
        return math.nan
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return float(value)


class ReportTarget(Protocol):
    def report(self, value: float, step: int) -> None: ...
    def should_prune(self) -> bool: ...


class ProgressTracker:
    """``on_progress`` for one trial: keeps the records, reports the metric, raises ``StopTrial`` to stop."""

    def __init__(self, trial: ReportTarget, metric: str, prune: bool = True, direction: str = "minimize") -> None:
        self.trial = trial
        self.direction = direction
        self.metric = metric
        self.prune = prune
        self.records: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_step: int | None = None
        self._reported: set[int] = set()

    def __call__(self, record: dict[str, Any]) -> None:
        if self.stop_reason is not None:  # already asked to stop; the runner may still be delivering records
            raise StopTrial(self.stop_reason)
        self.records.append(dict(record))
        value = record_value(record, self.metric)
        step = record.get("step")
        if value is None or not isinstance(step, int):
            return
        if step in self._reported:  # one value per step (every rank may append; the first one counts)
            return
        self._reported.add(step)
        if not math.isfinite(value):
            self.trial.report(diverged_value(self.direction), step)
            self._stop("diverged", step)
        self.trial.report(float(value), step)
        if self.prune and self.trial.should_prune():
            self._stop("pruned", step)

    def _stop(self, reason: str, step: int) -> None:
        self.stop_reason, self.stop_step = reason, step
        raise StopTrial(f"{reason} at step {step}")


def objective_value(
    metrics: Mapping[str, Any] | None, records: Sequence[Mapping[str, Any]], metric: str, window: int
) -> float | None:
    """The trial's value: ``metrics[metric]`` (the metric JSON) if there, else the mean of the last ``window``
    progress records' ``metric`` (one value per step); NaN when any step diverged (``record_value``: a run that
    went NaN is diverged, whatever its earlier losses); None when neither has it."""
    if metrics and isinstance(metrics.get(metric), (int, float)) and not isinstance(metrics.get(metric), bool):
        return float(metrics[metric])
    by_step: dict[int, float] = {}
    for record in records:
        value, step = record_value(record, metric), record.get("step")
        if value is not None and isinstance(step, int):
            by_step.setdefault(step, value)
    if not by_step:
        return None
    if any(not math.isfinite(v) for v in by_step.values()):
        return math.nan
    last = [by_step[s] for s in sorted(by_step)[-window:]]
    return sum(last) / len(last)
