"""The HPO study loop with a stand-in run function (no launches): pruning, failures, resume, the result files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("optuna")

import optuna

from shardspeed.autotuning.hpo import HpoJob, StopTrial, parse_space, run_study
from shardspeed.autotuning.hpo.optuna_parts import make_pruner, make_sampler, open_storage, session_seed
from shardspeed.autotuning.hpo.results import write_results
from shardspeed.autotuning.hpo.space import SpaceError

BASE_CONFIG = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def quadratic_run(launch: Any, on_progress: Any) -> SimpleNamespace:
    """A stand-in trial: geometric decay |1 - lr|^step (diverges for lr > 2), one record per step."""
    lr = launch.ds_config["optimizer"]["params"]["lr"]
    assert launch.ds_config["autotuning"]["end_profile_step"] == 6 and launch.exp_dir.is_dir()
    loss = 1.0
    for step in range(1, 7):
        on_progress({"step": step, "loss": loss})
        loss *= abs(1.0 - lr)
    return SimpleNamespace(status="ok", metric=123.0, metrics={"throughput": 123.0}, wall_s=0.0, error=None)


def make_job(tmp_path: Path, journal: bool = False, **study: Any) -> HpoJob:
    settings = {"n_trials": 6, "steps_per_trial": 6, "n_startup_trials": 2, "n_warmup_steps": 1, "seed": 0, **study}
    space = parse_space(
        {
            "study": settings,
            "params": {
                "lr": {"type": "float", "low": 1e-3, "high": 4.0, "log": True},
                "--width": {"type": "categorical", "choices": [16, 32]},
            },
        }
    )
    return HpoJob(
        space=space,
        script="train.py",
        script_args=["--width", "8", "--deepspeed_config", "ignored.json"],
        ds_config=BASE_CONFIG,
        num_procs=2,
        results_dir=tmp_path / "results",
        storage=f"journal:{tmp_path / 'results' / 'study.journal'}" if journal else None,
    )


def test_study_prunes_records_and_writes_the_best_trial(tmp_path: Path) -> None:
    job = make_job(tmp_path, n_trials=8)
    seen: list[int] = []
    study = run_study(job, run_fn=quadratic_run, on_trial=lambda t, n: seen.append(n))
    assert seen == list(range(1, 9))
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 3 and optuna.trial.TrialState.PRUNED in states
    best = study.best_trial
    # The objective is the mean of the last 3 per-step losses (the metric JSON has no "loss").
    lr = best.params["lr"]
    assert best.value == pytest.approx(sum(abs(1 - lr) ** k for k in (3, 4, 5)) / 3)

    summary = write_results(study, job, plots=False)
    out = job.results_dir
    record = json.loads((out / "best_trial.json").read_text())
    assert record["params"] == best.params and record["number"] == best.number
    config = json.loads((out / "best_config.json").read_text())
    assert config["optimizer"]["params"]["lr"] == lr and "autotuning" not in config  # the trial's stop is gone
    command = (out / "cmd_best.txt").read_text()
    assert f"--width {best.params['--width']} --deepspeed_config {out.resolve() / 'best_config.json'}" in command
    assert "ignored.json" not in command and "--num_procs 2 train.py" in command
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert len(rows) == 8 == summary["trials"] and {r["state"] for r in rows} >= {"COMPLETE", "PRUNED"}
    ranked = (out / "summary.txt").read_text().splitlines()
    assert ranked[2].split()[0] == str(best.number)  # best first, after the title and the header


def test_failures_are_recorded_and_the_study_goes_on(tmp_path: Path) -> None:
    calls = {"n": 0}

    def flaky(launch: Any, on_progress: Any) -> SimpleNamespace:
        calls["n"] += 1
        if calls["n"] == 2:
            return SimpleNamespace(status="failed", metric=None, metrics={}, wall_s=0.0, error="exit status 1: boom")
        if calls["n"] == 3:  # the runner's behaviour when our callback raised: "failed", but we asked to stop
            with pytest.raises(StopTrial):
                on_progress({"step": 1, "loss": math.inf})
            return SimpleNamespace(status="failed", metric=None, metrics={}, wall_s=0.0, error="on_progress raised")
        if calls["n"] == 4:  # a runner that lets the exception through
            on_progress({"step": 1, "loss": math.nan})
        return quadratic_run(launch, on_progress)

    study = run_study(make_job(tmp_path, n_trials=4, pruner="none", journal=True), run_fn=flaky)
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "FAIL", "PRUNED", "PRUNED"]
    assert study.trials[1].user_attrs["error"] == "failed: exit status 1: boom"
    assert study.trials[2].user_attrs["stopped"] == "diverged" == study.trials[3].user_attrs["stopped"]


def test_rerun_continues_the_stored_study(tmp_path: Path) -> None:
    first = run_study(make_job(tmp_path, n_trials=3, journal=True), run_fn=quadratic_run)
    kept = [(t.number, t.params) for t in first.trials]
    again = run_study(make_job(tmp_path, n_trials=5, journal=True), run_fn=quadratic_run)
    assert [(t.number, t.params) for t in again.trials[:3]] == kept and len(again.trials) == 5
    # New points, not the first run's start-up draws again ([Note: seeds across runs and workers]).
    assert again.trials[3].params != again.trials[0].params
    done = run_study(make_job(tmp_path, n_trials=5, journal=True), run_fn=quadratic_run)
    assert len(done.trials) == 5  # already finished: nothing runs


def test_a_missing_config_section_fails_the_trial_before_any_launch(tmp_path: Path) -> None:
    job = make_job(tmp_path, n_trials=1, journal=True)
    job.ds_config = {"train_batch_size": 8}
    with pytest.raises(SpaceError, match="no 'optimizer' section"):
        run_study(job, run_fn=quadratic_run)


def test_grid_sampler_walks_the_grid_and_refuses_floats(tmp_path: Path) -> None:
    space = parse_space(
        {
            "study": {"n_trials": 4, "steps_per_trial": 6, "sampler": "grid", "pruner": "none", "seed": 0},
            "params": {
                "lr": {"type": "categorical", "choices": [0.1, 0.5]},
                "--layers": {"type": "int", "low": 1, "high": 3, "step": 2},
            },
        }
    )
    job = HpoJob(space=space, script="t.py", script_args=[], ds_config=BASE_CONFIG, results_dir=tmp_path / "g")
    job.storage = f"journal:{tmp_path / 'g.journal'}"
    study = run_study(job, run_fn=quadratic_run)
    assert sorted((t.params["lr"], t.params["--layers"]) for t in study.trials) == [
        (0.1, 1),
        (0.1, 3),
        (0.5, 1),
        (0.5, 3),
    ]
    floats = parse_space({"study": {"sampler": "grid"}, "params": {"x": {"type": "float", "low": 0, "high": 1}}})
    with pytest.raises(SpaceError, match=r"params\['x'\]: the grid sampler needs categorical or int"):
        make_sampler(floats, 0)


@pytest.mark.parametrize("pruner", ["median", "percentile", "hyperband", "none"])
def test_every_pruner_builds(pruner: str) -> None:
    settings = parse_space({"study": {"pruner": pruner}, "params": {"lr": {"type": "float", "low": 0, "high": 1}}})
    assert isinstance(make_pruner(settings.study), optuna.pruners.BasePruner)


def test_storage_urls() -> None:
    with pytest.raises(SpaceError, match="expected a database URL"):
        open_storage("study.db")
    assert session_seed(0, 0, 0) != session_seed(0, 3, 0) != session_seed(0, 3, 1)
    assert session_seed(None, 3, 1) is None and session_seed(5, 2, 1) == session_seed(5, 2, 1)


def test_resume_refuses_an_edited_direction_or_space(tmp_path: Path) -> None:
    """Review G #7: the stored study was loaded whatever the file now said (mixed trials, disagreeing outputs)."""
    job = make_job(tmp_path, n_trials=1)
    run_study(job, run_fn=quadratic_run)
    for change in ({"study": {**job.space.study.model_dump(), "direction": "maximize"}},
                   {"params": {"lr": {"type": "float", "low": 1e-2, "high": 4.0, "log": True}}}):  # fmt: skip
        edited = HpoJob(**{**job.__dict__, "space": parse_space({**job.space.model_dump(), **change})})
        with pytest.raises(SpaceError, match="give another --study_name"):
            run_study(edited, run_fn=quadratic_run)
    more = HpoJob(**{**job.__dict__, "space": parse_space({**job.space.model_dump(), "study": {
        **job.space.study.model_dump(), "n_trials": 2}})})  # fmt: skip
    assert len(run_study(more, run_fn=quadratic_run).trials) == 2  # n_trials may change
