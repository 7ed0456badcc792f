"""``shardspeed hpo`` end to end with the launch swapped for a stand-in: arguments, files, exit codes, output."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("optuna")

from shardspeed.autotuning.hpo import launch as launch_module
from shardspeed.launcher.cli import main as shardspeed_main

SPACE = {
    "study": {"n_trials": 3, "steps_per_trial": 4, "seed": 1, "pruner": "none"},
    "params": {
        "lr": {"type": "float", "low": 0.01, "high": 1.0, "log": True},
        "--hidden": {"type": "int", "low": 4, "high": 8},
    },
}


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.json").write_text(json.dumps(SPACE))
    (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}))
    launches: list[Any] = []

    def run(launch: Any, on_progress: Any) -> SimpleNamespace:
        launches.append(launch)
        for step in range(1, 5):
            on_progress({"step": step, "loss": launch.ds_config["optimizer"]["params"]["lr"] * step})
        return SimpleNamespace(status="ok", metric=None, metrics={}, wall_s=0.0, error=None)

    monkeypatch.setattr(launch_module, "run_with_runner", run)
    monkeypatch.setattr(HpoFiles, "launches", launches, raising=False)
    return tmp_path


class HpoFiles:
    launches: list[Any]


def test_hpo_subcommand_runs_a_study_and_prints_the_best(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["hpo", "--space", "space.json", "--num_procs", "2", "--n_trials", "2", "--no_plots"]
    argv += ["train.py", "--hidden", "3", "--deepspeed_config", "ds.json", "--epochs", "1"]
    assert shardspeed_main(argv) == 0
    out = capsys.readouterr().out
    launches = HpoFiles.launches
    assert len(launches) == 2 and launches[0].num_procs == 2 and launches[0].script == "train.py"
    assert launches[0].script_args[:2] == ["--epochs", "1"] and launches[0].script_args[2] == "--hidden"
    assert "ds.json" not in " ".join(launches[0].script_args)  # the runner points the script at the trial's config
    assert "[hpo] trial 0 COMPLETE" in out and "(2/2)" in out and "[hpo] train with: shardspeed --num_procs 2" in out
    best = json.loads((files / "hpo_results" / "best_trial.json").read_text())
    # The value is the mean of the last 3 losses (lr x step, steps 2-4): 3 lr; the best is the smallest lr.
    lrs = [launch.ds_config["optimizer"]["params"]["lr"] for launch in launches]
    assert best["value"] == pytest.approx(3 * min(lrs)) and best["params"]["lr"] == min(lrs)
    assert (files / "hpo_results" / "study.journal").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train.py"], "the script's --deepspeed_config is required"),
        (["train.py", "--deepspeed_config", "missing.json"], "DeepSpeed config missing.json"),
    ],
)
def test_errors_exit_2_with_the_reason(
    files: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert shardspeed_main(["hpo", "--space", "space.json", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_space_file_names_the_entry(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (files / "space.json").write_text(json.dumps({"params": {"lr": {"type": "float", "low": 2, "high": 1}}}))
    assert shardspeed_main(["hpo", "--space", "space.json", "train.py", "--deepspeed_config", "ds.json"]) == 2
    assert "params.lr: low (2) must be <= high (1)" in capsys.readouterr().err
