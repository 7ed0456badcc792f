"""A ``run_study`` worker process whose trials are stand-ins (a short sleep, a value from the lr): the resume and
shared-study tests kill and run it. ``python hpo_fake_worker.py RESULTS_DIR N_TRIALS WORKER SLEEP_S [STORAGE]``."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shardspeed.autotuning.hpo import HpoJob, parse_space, run_study


def fake_run(sleep_s: float) -> Any:
    def run(launch: Any, on_progress: Any) -> SimpleNamespace:
        lr = launch.ds_config["optimizer"]["params"]["lr"]
        for step in range(1, 4):
            time.sleep(sleep_s / 3)
            on_progress({"step": step, "loss": math.log10(lr) ** 2 + 1.0 / step})
        return SimpleNamespace(status="ok", metric=None, metrics={}, wall_s=sleep_s, error=None)

    return run


def main() -> int:
    results_dir, n_trials, worker, sleep_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    space = parse_space(
        {
            "study": {"n_trials": n_trials, "steps_per_trial": 3, "seed": 0, "n_startup_trials": 3, "pruner": "none"},
            "params": {"lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
        }
    )
    job = HpoJob(
        space=space,
        script="train.py",
        script_args=[],
        ds_config={"optimizer": {"type": "SGD", "params": {}}},
        results_dir=results_dir,
        worker=worker,
        storage=sys.argv[5] if len(sys.argv) > 5 else None,
    )
    run_study(job, run_fn=fake_run(sleep_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
