"""``run_experiment`` with real launches of a tiny script (no torch): a script that ends before the window is a
"failed" trial, a trial the ``on_progress`` callback stops is "pruned" — its launcher and ranks gone — and a trial
past its time limit is "timeout"; none of them raises."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shardspeed.autotuning.runner import Experiment, run_experiment

SCRIPT = """
import json, os, sys, time
config = json.load(open(sys.argv[sys.argv.index("--deepspeed_config") + 1]))
mode = sys.argv[sys.argv.index("--mode") + 1]
if mode == "fail":
    sys.exit(3)
if os.environ["RANK"] != "0":  # as the engine: rank 0 writes the progress records
    time.sleep(1000)
with open(config["autotuning"]["progress_path"], "a") as out:
    for step in range(1, 1000):
        out.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\\n")
        out.flush()
        time.sleep(0.2)
"""


def _exp(tmp_path: Path, mode: str, timeout_s: float) -> Experiment:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    exp_dir = tmp_path / mode
    return Experiment(mode, str(script), ["--mode", mode], {"train_batch_size": 2}, 2, exp_dir, timeout_s)


@pytest.mark.slow  # two launches: ~10 s on idle cores, minutes on a loaded machine
@pytest.mark.timeout(600)
def test_failed_and_pruned_trials_are_recorded_and_stopped(tmp_path: Path) -> None:
    failed = run_experiment(_exp(tmp_path, "fail", 120))
    assert failed.status == "failed" and "exit status" in (failed.error or "") and failed.metric is None
    seen: list[dict] = []
    started = time.perf_counter()
    pruned = run_experiment(_exp(tmp_path, "prune", 120), on_progress=lambda r: seen.append(r) or r["step"] >= 3)
    assert pruned.status == "pruned" and "step 3" in (pruned.error or "")
    assert [r["step"] for r in seen][:3] == [1, 2, 3]
    assert time.perf_counter() - started < 100
    lines = (tmp_path / "prune" / "progress.jsonl").read_text().splitlines()
    time.sleep(1.0)
    assert (tmp_path / "prune" / "progress.jsonl").read_text().splitlines() == lines  # the ranks are gone
    assert json.loads((tmp_path / "prune" / "result.json").read_text())["status"] == "pruned"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trial_past_its_time_limit_is_a_timeout(tmp_path: Path) -> None:
    result = run_experiment(_exp(tmp_path, "slow", 15))
    assert result.status == "timeout" and "15 s" in (result.error or "")
