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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class StopTrial(Exception):
    """Raised from ``on_progress`` to stop the running trial (the pruner decided, or the loss diverged)."""


@dataclass
class TrialLaunch:
    """The fields of the runner's ``Experiment``: one short launch of the user's script with a trial's values."""

    name: str
    script: str
    script_args: list[str]
    ds_config: dict[str, Any]
    num_procs: int
    exp_dir: Path
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    launcher_args: list[str] = field(default_factory=list)
    """Launcher flags before the script (e.g. ``--module``)."""


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
    try:
        from shardspeed.autotuning.runner import Experiment, run_experiment
    except ImportError as error:  # the autotuner half of issue 19 is a separate module
        raise RuntimeError(
            f"shardspeed hpo needs the experiment runner (shardspeed.autotuning.runner): {error}"
        ) from error
    experiment = Experiment(
        name=launch.name,
        script=launch.script,
        script_args=list(launch.script_args),
        ds_config=launch.ds_config,
        num_procs=launch.num_procs,
        exp_dir=launch.exp_dir,
        timeout_s=launch.timeout_s,
        env=dict(launch.env),
        launcher_args=list(launch.launcher_args),
    )
    return run_experiment(experiment, on_progress)
