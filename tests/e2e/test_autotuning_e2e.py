"""``shardspeed --autotuning run`` for real: the profile launch, trials at world 2 through the launcher, memory
pruning under a simulated device budget, DeepSpeed's result files, then training with ds_config_optimal.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_SRC = Path(__file__).resolve().parents[2] / "src"
SCRIPT = REPO_SRC / "shardspeed" / "autotuning" / "trial_script.py"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_autotuning_run_tunes_prunes_and_trains_with_the_best_config(tmp_path: Path) -> None:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [1, 2]},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 2,
            "end_profile_step": 3,
            "max_train_micro_batch_size_per_gpu": 64,
            "num_tuning_micro_batch_sizes": 2,
            "tuner_num_trials": 2,
            "arg_mappings": {"train_micro_batch_size_per_gpu": "--micro_batch"},
            "trial_timeout_s": 300,
        },
    }
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "shardspeed.launcher.cli", "--autotuning", "run", "--num_procs", "2"]
    argv += ["--device_memory_gb", "0.01", str(SCRIPT), "--layers", "2", "--d_model", "64", "--context", "32"]
    argv += ["--steps", "3", "--deepspeed_config", "cfg.json"]
    env = {**os.environ, "PYTHONPATH": str(REPO_SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    rows = [json.loads(line) for line in (results / "trials.jsonl").read_text().splitlines()]
    statuses = [r["status"] for r in rows]
    assert statuses.count("ok") == 2 and statuses.count("pruned") > 0, statuses
    for row in rows:
        if row["status"] == "ok":  # the prediction made before the trial ran, against its peak RSS
            assert abs(row["predicted_bytes"] - row["measured_bytes"]) < 0.15 * row["measured_bytes"], row
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal and optimal["zero_optimization"]["stage"] in (1, 2)
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    assert (results / "metric_vs_micro_batch.png").read_bytes()[:4] == b"\x89PNG"
    assert "pruned without running" in (results / "summary.txt").read_text()
    assert "[autotuning] training with" in done.stderr and "1/2" in done.stderr  # the progress bar
    # the final launch trained all 3 steps: no trial exit (its config has no autotuning section)
    assert "autotuning: wrote" not in done.stderr.split("[autotuning] training with")[1]
