"""A NaN loss, in the record format the engine really writes, is divergence at every reader (review G #1)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("optuna")

import torch

from shardspeed.autotuning.hpo import HpoJob, parse_space, run_study
from shardspeed.autotuning.hpo.launch import StopTrial
from shardspeed.autotuning.hpo.progress import (
    DIVERGED_VALUE,
    ProgressTracker,
    objective_value,
    record_value,
)
from shardspeed.autotuning.hpo.range_test import _Collect, range_schedule
from shardspeed.autotuning.hpo.space import LRRangeTestSettings
from shardspeed.autotuning.probe import loss_fields


def engine_record(step: int, loss: float | None) -> dict[str, Any]:
    """What the probe appends to progress.jsonl, read back as the runner reads it."""
    tensor = None if loss is None else torch.tensor(loss)
    return json.loads(json.dumps({"step": step, **loss_fields(tensor), "samples_per_s": 1.0}))


class StubTrial:
    def __init__(self) -> None:
        self.reports: list[tuple[float, int]] = []

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return False


def test_the_engine_writes_nan_and_inf_as_a_flagged_null_and_no_loss_as_no_key() -> None:
    assert engine_record(1, math.nan) == {"step": 1, "loss": None, "loss_finite": False, "samples_per_s": 1.0}
    assert engine_record(1, math.inf)["loss_finite"] is False
    assert "loss" not in engine_record(1, None) and record_value(engine_record(1, None), "loss") is None
    assert record_value(engine_record(2, 0.5), "loss") == 0.5
    assert math.isnan(record_value({"step": 3, "loss": None}, "loss"))  # a null with its key: diverged


@pytest.mark.parametrize(("direction", "worst"), [("minimize", DIVERGED_VALUE), ("maximize", -DIVERGED_VALUE)])
def test_a_nan_record_stops_the_trial_as_diverged(direction: str, worst: float) -> None:
    trial = StubTrial()
    tracker = ProgressTracker(trial, "loss", direction=direction)
    tracker(engine_record(1, 1.0))
    with pytest.raises(StopTrial, match="diverged at step 2"):
        tracker(engine_record(2, math.nan))
    assert trial.reports[-1] == (worst, 2) and tracker.stop_reason == "diverged"


def test_the_objective_of_a_run_that_went_nan_is_not_finite() -> None:
    records = [engine_record(1, 1.0), engine_record(2, 0.01), engine_record(3, math.nan), engine_record(4, math.nan)]
    assert math.isnan(objective_value(None, records, "loss", 3))
    assert objective_value(None, records[:2], "loss", 3) == pytest.approx(0.505)


def test_the_range_test_stops_at_a_nan_record() -> None:
    collect = _Collect(range_schedule(1e-3, 1.0, 10), "loss", LRRangeTestSettings())
    collect(engine_record(1, 1.0))
    with pytest.raises(StopTrial, match="diverged at step 2"):
        collect(engine_record(2, math.nan))
    assert collect.diverged_at == 2


def test_a_run_that_improved_then_went_nan_never_wins(tmp_path: Path) -> None:
    """The review's probe: lr 1.0 falls fast then goes NaN; before the fix it completed with the best value."""

    def run(launch: Any, on_progress: Any) -> SimpleNamespace:
        lr = launch.ds_config["optimizer"]["params"]["lr"]
        for step in range(1, 11):
            loss = 0.001 if lr == 1.0 else 1.0 - lr * step / 20
            on_progress(engine_record(step, math.nan if lr == 1.0 and step > 6 else loss))
        return SimpleNamespace(status="ok", metric=None, metrics={}, wall_s=0.0, error=None)

    space = parse_space(
        {
            "study": {"n_trials": 2, "steps_per_trial": 10, "pruner": "none", "sampler": "grid"},
            "params": {"lr": {"type": "categorical", "choices": [1.0, 0.1]}},
        }
    )
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    job = HpoJob(space=space, script="t.py", script_args=[], ds_config=config, results_dir=tmp_path / "r")
    study = run_study(job, run_fn=run)
    states = {t.params["lr"]: t.state.name for t in study.trials}
    assert states == {1.0: "PRUNED", 0.1: "COMPLETE"} and study.best_trial.params["lr"] == 0.1
