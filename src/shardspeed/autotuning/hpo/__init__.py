"""Hyper-parameter search with Optuna (issue 19): ``shardspeed hpo`` and ``run_study``.

Files: ``space.py`` (the search-space JSON, typed), ``substitute.py`` (values into the config / script
arguments, pure), ``optuna_parts.py`` (storage, sampler, pruner, suggestions), ``progress.py`` (progress records
→ reports, pruning, the objective), ``launch.py`` (the seam to the experiment runner), ``study.py`` (the trial
loop), ``range_test.py`` (the LR range test first pass), ``results.py`` (best trial, table, plots), ``cli.py``.
Needs the ``hpo`` extra (``pip install 'shardspeed[hpo]'``: optuna).
"""

from __future__ import annotations

import importlib
from typing import Any

# Exported lazily: ``shardspeed hpo`` without optuna installed must reach its own "install the hpo extra" message
# (space / substitute / launch need no optuna; study and results do).
_EXPORTS = {
    "HpoJob": "study",
    "run_study": "study",
    "SearchSpace": "space",
    "SpaceError": "space",
    "load_space": "space",
    "parse_space": "space",
    "StopTrial": "launch",
    "TrialLaunch": "launch",
    "apply_to_args": "substitute",
    "apply_to_config": "substitute",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
