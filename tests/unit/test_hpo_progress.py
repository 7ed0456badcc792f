"""Progress records → Optuna reports, the prune decision and the objective value (a stub trial, no processes)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("optuna")

from shardspeed.autotuning.hpo.launch import StopTrial
from shardspeed.autotuning.hpo.progress import DIVERGED_VALUE, ProgressTracker, objective_value


class StubTrial:
    def __init__(self, prune_after: int | None = None) -> None:
        self.reports: list[tuple[float, int]] = []
        self.prune_after = prune_after

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return self.prune_after is not None and len(self.reports) >= self.prune_after


def test_reports_each_step_once_and_ignores_records_without_the_metric() -> None:
    trial = StubTrial()
    tracker = ProgressTracker(trial, "loss")
    for record in ({"step": 1, "loss": 2.0}, {"step": 1, "loss": 9.0}, {"step": 2, "samples_per_sec": 5.0}):
        tracker(record)
    tracker({"step": 2, "loss": 1.0})
    assert trial.reports == [(2.0, 1), (1.0, 2)] and len(tracker.records) == 4 and tracker.stop_reason is None


def test_prune_and_divergence_stop_the_trial() -> None:
    tracker = ProgressTracker(StubTrial(prune_after=2), "loss")
    tracker({"step": 1, "loss": 2.0})
    with pytest.raises(StopTrial, match="pruned at step 2"):
        tracker({"step": 2, "loss": 1.5})
    with pytest.raises(StopTrial):  # later records keep saying stop
        tracker({"step": 3, "loss": 1.0})
    assert (tracker.stop_reason, tracker.stop_step) == ("pruned", 2)

    trial = StubTrial()
    diverged = ProgressTracker(trial, "loss", prune=False)
    with pytest.raises(StopTrial, match="diverged at step 4"):
        diverged({"step": 4, "loss": math.nan})
    assert trial.reports == [(DIVERGED_VALUE, 4)]


def test_no_pruning_when_switched_off() -> None:
    tracker = ProgressTracker(StubTrial(prune_after=1), "loss", prune=False)
    tracker({"step": 1, "loss": 2.0})
    assert tracker.stop_reason is None


def test_objective_prefers_the_metric_json_then_averages_the_last_steps() -> None:
    records = [{"step": s, "loss": float(s)} for s in range(1, 6)] + [{"step": 5, "loss": 99.0}]
    assert objective_value({"loss": 0.5}, records, "loss", 3) == 0.5
    assert objective_value({"throughput": 3.0}, records, "loss", 3) == pytest.approx(4.0)  # steps 3, 4, 5
    assert objective_value({}, records, "loss", 1) == 5.0  # the first record of a step counts
    assert objective_value(None, [], "loss", 3) is None
