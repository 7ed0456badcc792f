"""A trial's launch, as the experiment runner (issue 19's ``autotuning/runner.py``) takes it.

The study builds a ``TrialLaunch`` and hands it to a ``RunFn``. The default one converts it to the runner's
``Experiment`` and calls ``run_experiment`` — a real short launch through the ``shardspeed`` launcher whose engine
appends per-step records (``{"step", "loss", ...}``) that reach ``on_progress`` while the trial runs, and exits
after ``autotuning.end_profile_step``. Tests pass their own ``RunFn`` (no processes); anything returning an object
with the ``RunResult`` attributes works.

[Note: stopping a pruned trial] ``on_progress`` raises ``StopTrial`` when the pruner says stop. The runner's
contract is that a callback's exception stops (kills) the launch; whether the runner then reports the result as
``"pruned"``, ``"failed"`` or lets the exception through, the study knows it asked and records the trial as pruned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from shardspeed.autotuning.runner import Experiment, run_experiment


class StopTrial(Exception):
    """Raised from ``on_progress`` to stop the running trial (the pruner decided, or the loss diverged)."""


TrialLaunch = Experiment
"""A trial's launch is the runner's ``Experiment`` (name, script, script_args, ds_config, num_procs, exp_dir,
timeout_s, env, launcher_args)."""


class RunResult(Protocol):
    """What the study reads from a finished launch (the runner's ``ExperimentResult``)."""

    status: str  # "ok" | "failed" | "timeout" | "pruned"
    metric: float | None
    metrics: dict[str, Any]
    wall_s: float
    error: str | None


ProgressFn = Callable[[dict[str, Any]], None]
RunFn = Callable[[TrialLaunch, ProgressFn | None], RunResult]


def run_with_runner(launch: TrialLaunch, on_progress: ProgressFn | None = None) -> RunResult:
    """The default ``RunFn``: the autotuner's experiment runner (a real launch)."""
    return run_experiment(launch, on_progress)
