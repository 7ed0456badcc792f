"""The LR range test pass: its schedule, the narrowing rule (pure), and the pass over a stand-in launch."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("optuna")

from shardspeed.autotuning.hpo import HpoJob, parse_space, run_study
from shardspeed.autotuning.hpo.range_test import lr_of_step, narrow_lr_range, range_schedule, run_range_test
from shardspeed.autotuning.hpo.space import LRRangeTestSettings


def test_the_schedule_ramps_linearly_from_low_to_high() -> None:
    schedule = range_schedule(0.01, 1.0, 100)
    assert lr_of_step(1, schedule) == pytest.approx(0.01)
    assert lr_of_step(100, schedule) == pytest.approx(1.0)
    assert lr_of_step(51, schedule) == pytest.approx(0.01 + 0.99 * 50 / 99)


def test_narrowing_takes_the_lowest_loss_before_divergence() -> None:
    settings = LRRangeTestSettings(enabled=True, span=10.0, diverge_factor=4.0)
    points = [(0.1, 5.0), (0.5, 3.0), (1.0, 1.0), (2.0, 0.8), (3.0, 4.0), (4.0, 0.1)]  # diverged at 3.0 (> 4 x 0.8)
    assert narrow_lr_range(points, settings, 1e-3, 10.0) == pytest.approx((0.2, 2.0))
    assert narrow_lr_range([*points[:4], (3.0, float("nan")), (4.0, 0.1)], settings, 1e-3, 10.0) == pytest.approx(
        (0.2, 2.0)
    )
    assert narrow_lr_range(points, settings, 0.5, 1.5) == pytest.approx((0.5, 1.5))  # clipped to the original
    assert narrow_lr_range([], settings, 1e-3, 10.0) == (1e-3, 10.0)


def _job(tmp_path: Path) -> HpoJob:
    space = parse_space(
        {
            "study": {"n_trials": 3, "steps_per_trial": 5, "lr_range_test": {"enabled": True, "steps": 50}},
            "params": {"lr": {"type": "float", "low": 1e-3, "high": 10.0, "log": True}},
        }
    )
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR", "params": {}}}
    return HpoJob(space=space, script="t.py", script_args=[], ds_config=config, results_dir=tmp_path / "r")


def test_the_pass_narrows_the_studys_lr_range(tmp_path: Path) -> None:
    launches: list[Any] = []

    def run(launch: Any, on_progress: Any) -> SimpleNamespace:
        launches.append(launch)
        if launch.name == "lr_range_test":
            assert launch.ds_config["scheduler"]["type"] == "LRRangeTest"
            assert launch.ds_config["autotuning"]["end_profile_step"] == 50
            schedule = launch.ds_config["scheduler"]["params"]
            loss = 1.0
            for step in range(1, 51):  # trains while lr < 2, diverges beyond
                on_progress({"step": step, "loss": loss})
                loss *= 0.9 if lr_of_step(step, schedule) < 2.0 else 3.0
        else:
            on_progress({"step": 1, "loss": 1.0})
        return SimpleNamespace(status="ok", metric=None, metrics={}, wall_s=0.0, error=None)

    job = _job(tmp_path)
    study = run_study(job, run_fn=run)
    record = json.loads((job.results_dir / "lr_range_test.json").read_text())
    low, high = record["narrowed"]
    assert 1.7 < high < 2.1 and low == pytest.approx(high / 10)
    assert record["status"].startswith("stopped: diverged at step")
    assert (job.results_dir / "lr_range_test.png").stat().st_size > 0
    assert all(low <= t.params["lr"] <= high for t in study.trials) and len(study.trials) == 3
    assert study.user_attrs["lr_bounds"] == [low, high]
    # A resumed study reuses the stored range: no second pass.
    job.space = parse_space({**job.space.model_dump(), "study": {**job.space.study.model_dump(), "n_trials": 4}})
    run_study(job, run_fn=run)
    assert [launch.name for launch in launches].count("lr_range_test") == 1
    assert run_range_test  # the pass is also callable alone
