"""HPO on the toy task with a known good learning-rate range: does ``shardspeed hpo`` find an lr inside it?

``python benchmarks/bench_hpo.py [--trials 12] [--steps 30] [--num_procs 2] [--lr-range-test]``

1. The good range is measured, not assumed: a dense single-process sweep of the toy task (``hpo_toy_task.py``:
   least squares whose Hessian spectrum is fixed by construction) gives the lrs whose score — the mean of the last
   3 losses after ``--steps`` steps — is ≤ ``--factor`` x the initial loss; it must lie below 2 / h_max (where
   SGD diverges), which is checked too.
2. The study: TPE (seeded) over lr ∈ [1e-3, 10] log-uniform, median pruning on the per-step losses the engine
   reports, each trial a real ``--num_procs``-rank launch through the shardspeed launcher
   (``run_study`` → the autotuner's ``run_experiment``), optionally after the LR range test pass.
3. Printed: the range, the best trial, whether its lr is inside, its value against the single-process
   simulation at the same lr (data-parallel parity), trials by state, wall clock (total, median per trial).
Exit status 0 when the best lr is inside the good range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import hpo_toy_task as toy

from shardspeed.autotuning.hpo import HpoJob, parse_space, run_study
from shardspeed.autotuning.hpo.results import write_results

TOY_CONFIG = {"train_micro_batch_size_per_gpu": toy.ROWS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def toy_job(results_dir: Path, trials: int, steps: int, num_procs: int, seed: int, lr_range_test: bool) -> HpoJob:
    space = parse_space(
        {
            "study": {
                "n_trials": trials,
                "steps_per_trial": steps,
                "seed": seed,
                "n_startup_trials": 4,
                "n_warmup_steps": 5,
                "trial_timeout_s": 300,
                "lr_range_test": {"enabled": lr_range_test, "steps": 60},
            },
            "params": {"lr": {"type": "float", "low": 1e-3, "high": 10.0, "log": True}},
        }
    )
    return HpoJob(
        space=space,
        script=str(Path(__file__).with_name("hpo_toy_task.py")),
        script_args=["--steps", str(10 * steps)],
        ds_config=TOY_CONFIG,
        num_procs=num_procs,
        results_dir=results_dir,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--num_procs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--factor", type=float, default=1e-3)
    parser.add_argument("--lr-range-test", action="store_true")
    parser.add_argument("--results-dir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir or tempfile.mkdtemp(prefix="bench_hpo_"))

    lo, hi = toy.good_range(args.steps, args.factor)
    print(f"good lr range (score <= {args.factor:g} x initial loss after {args.steps} steps): [{lo:.3g}, {hi:.3g}]")
    print(f"divergence bound 2/h_max = {2 / toy.H_MAX:.3g}: {'ok' if hi < 2 / toy.H_MAX else 'VIOLATED'}")
    job = toy_job(results_dir, args.trials, args.steps, args.num_procs, args.seed, args.lr_range_test)
    start = time.perf_counter()
    study = run_study(job, on_trial=lambda t, n: print(f"  trial {t.number} {t.state.name} {t.params} {t.value}"))
    wall = time.perf_counter() - start
    summary = write_results(study, job)
    best = summary["best"]
    states: dict[str, int] = {}
    for trial in study.trials:
        states[trial.state.name] = states.get(trial.state.name, 0) + 1
    walls = [t.user_attrs["wall_s"] for t in study.trials if "wall_s" in t.user_attrs]
    if job.space.study.lr_range_test.enabled:
        narrowed = json.loads((results_dir / "lr_range_test.json").read_text())["narrowed"]
        print(f"LR range test narrowed lr to [{narrowed[0]:.3g}, {narrowed[1]:.3g}]")
    print(f"trials: {states}; wall {wall:.0f} s (median per trial {statistics.median(walls):.1f} s)")
    if best is None:
        print("no trial completed")
        return 1
    lr = best["params"]["lr"]
    simulated = toy.score(toy.simulate(lr, args.steps))
    inside = lo <= lr <= hi
    print(f"best trial {best['number']}: lr {lr:.4g} -> {'INSIDE' if inside else 'OUTSIDE'} [{lo:.3g}, {hi:.3g}]")
    print(
        f"best value {best['value']:.6g} vs single-process simulation {simulated:.6g} "
        f"(rel. diff {abs(best['value'] - simulated) / max(simulated, 1e-30):.2e})"
    )
    print(f"results: {results_dir}")
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
