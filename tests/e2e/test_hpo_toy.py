"""``shardspeed hpo`` with real 2-rank launches on the toy task whose good lr range is measured: the best lr lies
inside it, and the best trial's value equals the single-process simulation at that lr (data-parallel parity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hpo_toy_task as toy  # noqa: E402

STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 12 real 2-rank trials: ~40 s each on 2 busy cores
def test_hpo_finds_an_lr_inside_the_toy_tasks_good_range(tmp_path: Path) -> None:
    lo, hi = toy.good_range(STEPS)
    assert 0.5 < lo < hi < 2 / toy.H_MAX  # the window the task's spectrum predicts
    space = {
        "study": {"n_trials": 12, "steps_per_trial": STEPS, "seed": 0, "n_startup_trials": 4, "trial_timeout_s": 300},
        "params": {"lr": {"type": "float", "low": 1e-3, "high": 10.0, "log": True}},
    }
    (tmp_path / "space.json").write_text(json.dumps(space))
    config = {"train_micro_batch_size_per_gpu": toy.ROWS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, "-m", "shardspeed.launcher.cli", "hpo", "--space", "space.json", "--num_procs", "2"]
    argv += ["--worker", "0"]  # reproducible draws (the default worker index is a host/pid hash)
    argv += [str(ROOT / "benchmarks" / "hpo_toy_task.py"), "--steps", "300", "--deepspeed_config", "ds.json"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    best = json.loads((tmp_path / "hpo_results" / "best_trial.json").read_text())
    lr = best["params"]["lr"]
    assert lo <= lr <= hi, f"best lr {lr} outside [{lo}, {hi}]\n{done.stdout}"
    assert best["value"] == pytest.approx(toy.score(toy.simulate(lr, STEPS)), rel=1e-4)
    results = tmp_path / "hpo_results"
    assert (results / "optimization_history.png").stat().st_size > 0 and (results / "trials.csv").exists()
    assert "--deepspeed_config" in (results / "cmd_best.txt").read_text()
