"""``run_study``: an Optuna study whose trials are short real launches of the user's training script.

One trial: the sampler picks values (``optuna_parts.suggest``), ``substitute`` writes them into a copy of the
DeepSpeed config and the script's arguments, the ``autotuning`` section asks the engine to stop after
``steps_per_trial`` steps and append per-step records, and the run function launches it (``launch.py``). While it
runs, each record goes to a ``ProgressTracker`` (report + prune); when it ends, the value is the metric JSON's
``metric`` or the mean of the last progress values. A failed or timed-out launch is a FAIL trial with its error in
the trial's user attributes, never the end of the study. Storage, resume and workers: [Note: study storage].
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from shardspeed.autotuning.hpo import launch as launch_module
from shardspeed.autotuning.hpo import optuna_parts
from shardspeed.autotuning.hpo.launch import RunFn, StopTrial, TrialLaunch
from shardspeed.autotuning.hpo.progress import ProgressTracker, objective_value
from shardspeed.autotuning.hpo.space import SearchSpace, SpaceError
from shardspeed.autotuning.hpo.substitute import apply_to_args, apply_to_config

FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
LR_BOUNDS_ATTR = "lr_bounds"


@dataclass
class HpoJob:
    """Everything one ``shardspeed hpo`` run needs; the CLI and the Python API both build one."""

    space: SearchSpace
    script: str
    script_args: list[str]
    ds_config: dict[str, Any]
    num_procs: int = 1
    results_dir: Path = Path("hpo_results")
    storage: str | None = None
    study_name: str = "hpo"
    worker: int = 0
    env: dict[str, str] = field(default_factory=dict)
    launcher_args: list[str] = field(default_factory=list)


def trial_config(job: HpoJob, params: dict[str, Any]) -> dict[str, Any]:
    """The trial's DeepSpeed config: the user's, the trial's values, and the engine's stop/report settings."""
    config = apply_to_config(job.ds_config, params, job.num_procs)
    autotuning = dict(config.get("autotuning") or {})
    steps = job.space.study.steps_per_trial
    # The engine measures from the end of start_profile_step (< end) and exits after end_profile_step.
    start = max(1, min(int(autotuning.get("start_profile_step", 1)), steps - 1))
    autotuning.update(enabled=True, start_profile_step=start, end_profile_step=steps)
    config["autotuning"] = autotuning
    return config


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's ExperimentalWarning (heartbeat, matplotlib plots: features we chose knowingly)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


def count_finished(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def _launch(job: HpoJob, name: str, params: dict[str, Any]) -> TrialLaunch:
    return TrialLaunch(
        name=name,
        script=job.script,
        script_args=apply_to_args(job.script_args, params),
        ds_config=trial_config(job, params),
        num_procs=job.num_procs,
        exp_dir=(job.results_dir / "trials" / name).resolve(),
        timeout_s=job.space.study.trial_timeout_s,
        env=dict(job.env),
        launcher_args=list(job.launcher_args),
    )


def run_trial(job: HpoJob, trial: optuna.Trial, run_fn: RunFn, lr_bounds: tuple[float, float] | None) -> float:
    """One trial: suggest, launch, track; returns the value or raises ``optuna.TrialPruned`` / ``TrialFailed``."""
    settings = job.space.study
    params = {
        name: optuna_parts.suggest(trial, name, param, lr_bounds if name == "lr" else None)
        for name, param in job.space.params.items()
    }
    launch = _launch(job, f"trial_{trial.number:04d}", params)
    launch.exp_dir.mkdir(parents=True, exist_ok=True)
    trial.set_user_attr("exp_dir", str(launch.exp_dir))
    trial.set_user_attr("worker", job.worker)
    tracker = ProgressTracker(trial, settings.metric, prune=settings.pruner != "none", direction=settings.direction)
    start = time.perf_counter()
    result = None
    with contextlib.suppress(StopTrial):  # the runner let our callback's exception through ([Note: stopping ...])
        result = run_fn(launch, tracker)
    trial.set_user_attr("wall_s", round(time.perf_counter() - start, 3))
    if tracker.stop_reason is not None or (result is not None and result.status == "pruned"):
        trial.set_user_attr("stopped", tracker.stop_reason or "pruned")
        raise optuna.TrialPruned(f"{tracker.stop_reason or 'pruned'} at step {tracker.stop_step}")
    if result is None:  # the run function raised StopTrial although the tracker never asked
        trial.set_user_attr("error", "the run function raised StopTrial itself")
        raise TrialFailed(f"trial {trial.number}: the run function raised StopTrial itself")
    if result.status != "ok":
        trial.set_user_attr("error", f"{result.status}: {result.error or ''}"[:2000])
        raise TrialFailed(f"trial {trial.number} {result.status}: {result.error}")
    value = objective_value(result.metrics, tracker.records, settings.metric, settings.metric_window)
    if value is None:
        trial.set_user_attr("error", f"no {settings.metric!r} in the metric JSON or the progress records")
        raise TrialFailed(f"trial {trial.number}: no value for metric {settings.metric!r}")
    if not math.isfinite(value):
        trial.set_user_attr("stopped", "diverged")
        raise optuna.TrialPruned("non-finite metric")
    return value


class TrialFailed(RuntimeError):
    """A trial's launch failed or produced no metric: recorded as FAIL, the study goes on."""


def create_study(job: HpoJob) -> optuna.Study:
    job.results_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own per-trial lines replace Optuna's
    with quiet_optuna():
        storage = optuna_parts.open_storage(job.storage or optuna_parts.default_storage(job.results_dir))
    settings = job.space.study
    study = optuna.create_study(
        study_name=job.study_name,
        storage=storage,
        direction=settings.direction,
        pruner=optuna_parts.make_pruner(settings),
        load_if_exists=True,
    )
    check_resume(study, job.space)
    study.sampler = optuna_parts.make_sampler(
        job.space, optuna_parts.session_seed(settings.seed, len(study.trials), job.worker)
    )
    if study.user_attrs.get("space") is None:
        study.set_user_attr("space", job.space.model_dump(mode="json"))
    return study


def check_resume(study: optuna.Study, space: SearchSpace) -> None:
    """A stored study continues only under the space it was made with: the same direction, metric and params
    (``n_trials``, timeouts and the like may change). Another space would mix trials of different questions, and
    the stored ``lr_bounds`` would outlive an edited lr range."""
    stored = study.user_attrs.get("space")
    direction = study.direction.name.lower()
    problems = []
    if direction != space.study.direction:
        problems.append(f"direction {direction} (the file says {space.study.direction})")
    if stored is not None:
        now = space.model_dump(mode="json")
        if stored.get("study", {}).get("metric") != now["study"]["metric"]:
            problems.append(
                f"metric {stored.get('study', {}).get('metric')!r} (the file says {now['study']['metric']!r})"
            )
        if stored.get("params") != now["params"]:
            changed = sorted(set(stored.get("params", {})) ^ set(now["params"])) or sorted(
                name for name in now["params"] if stored["params"].get(name) != now["params"][name]
            )
            problems.append(f"other params ({', '.join(changed)} differ)")
    if problems:
        raise SpaceError(
            f"study {study.study_name!r} in the storage was made with {'; '.join(problems)}: give another "
            "--study_name (or --results_dir) for the edited space, or restore the file to continue it"
        )


def run_study(
    job: HpoJob,
    run_fn: RunFn | None = None,
    on_trial: Callable[[optuna.trial.FrozenTrial, int], None] | None = None,
    lr_range_fn: Callable[[HpoJob, RunFn], tuple[float, float]] | None = None,
) -> optuna.Study:
    """Run trials until the study holds ``n_trials`` finished ones (or ``timeout_s`` passed); returns the study.

    Re-running continues the stored study; ``on_trial(frozen_trial, finished_count)`` is called after each trial.
    """
    settings = job.space.study
    run_fn = run_fn or launch_module.run_with_runner  # read at call time: tests swap the real launch out
    study = create_study(job)
    lr_bounds = _lr_bounds(job, study, run_fn, lr_range_fn)
    remaining = None if settings.n_trials is None else settings.n_trials - count_finished(study)
    if remaining is not None and remaining <= 0:
        return study
    callbacks: list[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] = []
    if settings.n_trials is not None:
        # Counted over the whole study, so a resumed run or a second worker stops at the study's total.
        callbacks.append(optuna.study.MaxTrialsCallback(settings.n_trials, states=FINISHED))
    if on_trial is not None:
        callbacks.append(lambda s, t: on_trial(t, count_finished(s)))
    with quiet_optuna():
        optuna.storages.fail_stale_trials(study)  # a dead worker's RUNNING trials (heartbeat storages only)
        study.optimize(
            lambda trial: run_trial(job, trial, run_fn, lr_bounds),
            n_trials=remaining,
            timeout=settings.timeout_s,
            catch=(TrialFailed,),
            callbacks=callbacks,
            gc_after_trial=False,
        )
    return study


def _lr_bounds(
    job: HpoJob, study: optuna.Study, run_fn: RunFn, lr_range_fn: Callable[[HpoJob, RunFn], tuple[float, float]] | None
) -> tuple[float, float] | None:
    """The narrowed lr range: stored in the study once (resumed runs and other workers reuse it)."""
    stored = study.user_attrs.get(LR_BOUNDS_ATTR)
    if stored is not None:
        return (float(stored[0]), float(stored[1]))
    if not job.space.study.lr_range_test.enabled:
        return None
    if lr_range_fn is None:
        from shardspeed.autotuning.hpo.range_test import run_range_test as lr_range_fn
    low, high = lr_range_fn(job, run_fn)
    study.set_user_attr(LR_BOUNDS_ATTR, [low, high])
    return (low, high)


def load_config(path: str | Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SpaceError(f"DeepSpeed config {path}: {error}") from None
    if not isinstance(config, dict):
        raise SpaceError(f"DeepSpeed config {path}: expected a JSON object")
    return config
