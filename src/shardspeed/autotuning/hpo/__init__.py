"""Hyper-parameter search with Optuna (issue 19): ``shardspeed hpo`` and ``run_study``.

Files: ``space.py`` (the search-space JSON, typed), ``substitute.py`` (values into the config / script
arguments, pure), ``optuna_parts.py`` (storage, sampler, pruner, suggestions), ``progress.py`` (progress records
→ reports, pruning, the objective), ``launch.py`` (the seam to the experiment runner), ``study.py`` (the trial
loop), ``range_test.py`` (the LR range test first pass), ``results.py`` (best trial, table, plots), ``cli.py``.
Needs the ``hpo`` extra (``pip install 'shardspeed[hpo]'``: optuna).
"""

from __future__ import annotations

from shardspeed.autotuning.hpo.launch import StopTrial, TrialLaunch
from shardspeed.autotuning.hpo.space import SearchSpace, SpaceError, load_space, parse_space
from shardspeed.autotuning.hpo.study import HpoJob, run_study
from shardspeed.autotuning.hpo.substitute import apply_to_args, apply_to_config

__all__ = [
    "HpoJob",
    "SearchSpace",
    "SpaceError",
    "StopTrial",
    "TrialLaunch",
    "apply_to_args",
    "apply_to_config",
    "load_space",
    "parse_space",
    "run_study",
]
