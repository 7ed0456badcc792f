"""Optuna's pieces built from the typed settings: storage, sampler, pruner, and a trial's suggestions.

[Note: study storage] The default is a file-based study in the results directory, Optuna's journal file
``<results_dir>/study.journal`` (``journal:PATH``): re-running the same command (same ``--study_name``) loads it
and continues (finished trials are kept; ``n_trials`` counts the whole study's finished trials, not this run's).
A journal is one append-only log, safe for several processes on one file system (two workers on one machine, or
NFS), and costs ~0.1 s per trial here; SQLite (``sqlite:///PATH``) took ~2 s per trial and ~7 s to open on the
same loaded machine. Any SQLAlchemy URL works too — ``postgresql://user:pw@host/db`` or
``mysql+pymysql://user:pw@host/db`` lets workers on several machines share one study (start ``shardspeed hpo``
on each with the same ``--storage`` and ``--study_name`` and its own ``--worker``). RDB storages run Optuna's
heartbeat: a trial whose worker died mid-trial is marked FAIL once its heartbeat is ``GRACE_S`` old, when a
worker next starts; on a journal such a trial stays RUNNING (ignored: it never counts as finished).

[Note: seeds across runs and workers] A seeded sampler that restarts would draw the same random start-up points
again. Each session seeds its sampler with (seed, trials already in the study, worker) so a resumed study and a
second worker draw new points, and the same command on the same stored study draws the same ones. The CLI's
default worker (no ``--worker``) is a hash of host and pid, so two workers started alike still differ (the draws are
then not reproducible; give ``--worker`` for that). The Python API's ``HpoJob.worker`` defaults to 0.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna

from shardspeed.autotuning.hpo.space import ParamSpace, SearchSpace, SpaceError, StudySettings

HEARTBEAT_S = 5
RDB_OPEN_ATTEMPTS = 4
GRACE_S = 20


def default_storage(results_dir: Path) -> str:
    return f"journal:{(results_dir / 'study.journal').resolve()}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage from a URL (``sqlite:///...``, ``postgresql://...``, ``mysql://...``, ``journal:PATH``,
    or ``memory:`` — this process only, nothing to resume: quick searches through the Python API and tests)."""
    if url == "memory:":
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise SpaceError(
            f"--storage {url!r}: expected a database URL (sqlite:///PATH, postgresql://...) or journal:PATH"
        )
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Two workers on one SQLite file take turns on its lock; wait for it rather than fail.
        engine_kwargs["connect_args"] = {"timeout": 60}
    # Two workers opening a new database at once race to create Optuna's tables (one gets an IntegrityError on
    # alembic's version row); the loser retries and finds them made.
    for attempt in range(RDB_OPEN_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S
            )
        except Exception as error:  # sqlalchemy's errors; sqlalchemy is optuna's dependency, not ours
            if attempt + 1 == RDB_OPEN_ATTEMPTS or type(error).__module__.split(".")[0] != "sqlalchemy":
                raise
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def session_seed(seed: int | None, trials_in_study: int, worker: int) -> int | None:
    """The sampler's seed for this session ([Note: seeds across runs and workers])."""
    if seed is None:
        return None
    return (seed * 1_000_003 + trials_in_study * 7_919 + worker * 104_729) % (2**31 - 1)


def _grid(space: SearchSpace) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for name, param in space.params.items():
        if param.type == "categorical":
            grid[name] = list(param.choices or [])
        elif param.type == "int" and not param.log:
            step = int(param.step or 1)
            grid[name] = list(range(int(param.low or 0), int(param.high or 0) + 1, step))
        else:
            raise SpaceError(f"params[{name!r}]: the grid sampler needs categorical or int (non-log) parameters")
    return grid


def make_sampler(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    settings = space.study
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if settings.sampler == "grid":
        return optuna.samplers.GridSampler(_grid(space), seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=settings.n_startup_trials)


def make_pruner(settings: StudySettings) -> optuna.pruners.BasePruner:
    if settings.pruner == "none":
        return optuna.pruners.NopPruner()
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=max(1, settings.n_warmup_steps), max_resource=settings.steps_per_trial
        )
    if settings.pruner == "percentile":
        return optuna.pruners.PercentilePruner(
            25.0, n_startup_trials=settings.n_startup_trials, n_warmup_steps=settings.n_warmup_steps
        )
    return optuna.pruners.MedianPruner(
        n_startup_trials=settings.n_startup_trials, n_warmup_steps=settings.n_warmup_steps
    )


def suggest(trial: optuna.Trial, name: str, param: ParamSpace, bounds: tuple[float, float] | None = None) -> Any:
    """The trial's value for one parameter; ``bounds`` overrides low/high (the LR range test's narrowing)."""
    low, high = bounds if bounds is not None else (param.low, param.high)
    if param.type == "categorical":
        return trial.suggest_categorical(name, list(param.choices or []))
    if param.type == "int":
        step = int(param.step) if param.step is not None else 1
        return trial.suggest_int(name, int(low or 0), int(high or 0), step=step, log=param.log)
    return trial.suggest_float(name, float(low or 0.0), float(high or 0.0), step=param.step, log=param.log)
