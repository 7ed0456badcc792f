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


def test_launcher_options_before_the_script_reach_every_trial_and_the_command(files: Path) -> None:
    """Review G #5: ``--module`` / ``--include`` before the script went nowhere (argparse refused them)."""
    argv = ["hpo", "--space", "space.json", "--module", "--include", "localhost:0", "--n_trials", "1", "--no_plots"]
    argv += ["pkg.train", "--deepspeed_config", "ds.json"]
    assert shardspeed_main(argv) == 0
    launch = HpoFiles.launches[0]
    assert launch.launcher_args == ["--module", "--include", "localhost:0"] and launch.script == "pkg.train"
    command = (files / "hpo_results" / "cmd_best.txt").read_text()
    assert command.startswith("shardspeed --module --include localhost:0 --num_procs 1 pkg.train")


def test_an_unknown_or_per_trial_launcher_option_is_a_usage_error(files: Path) -> None:
    base = ["hpo", "--space", "space.json", "--no_plots"]
    assert shardspeed_main([*base, "--no_such_option", "t.py", "--deepspeed_config", "ds.json"]) == 2
    assert shardspeed_main([*base, "--master_port", "29999", "t.py", "--deepspeed_config", "ds.json"]) == 2
    assert HpoFiles.launches == []


def test_workers_without_worker_index_draw_different_seeds() -> None:
    """Review G #8: the default was worker 0 for every process; now a host/pid hash (an explicit index wins)."""
    from shardspeed.autotuning.hpo.cli import build_parser, default_worker, split_launcher_args

    own, launcher = split_launcher_args(["--space", "s.json", "--worker", "3", "t.py"])
    assert build_parser().parse_args(own).worker == 3 and launcher == []
    assert build_parser().parse_args(["--space", "s.json", "t.py"]).worker is None
    assert default_worker() == default_worker()  # stable within a process, differs with the pid
    import subprocess
    import sys

    code = "from shardspeed.autotuning.hpo.cli import default_worker; print(default_worker())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(other) != default_worker()


def test_sigterm_unwinds_so_the_trials_finally_runs() -> None:
    """Review G #9: Python's default SIGTERM kills the process without running the runner's ``finally``."""
    import os
    import signal

    from shardspeed.autotuning.hpo.cli import sigterm_unwinds

    cleaned: list[bool] = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, sigterm_unwinds():
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode boundary
        finally:
            cleaned.append(True)
    assert stopped.value.code == 128 + signal.SIGTERM and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) == before
