"""The hyper-parameter search-space file (JSON): what to search and how the study runs, typed at the boundary.

::

    {
      "study": {"direction": "minimize", "metric": "loss", "n_trials": 20, "seed": 0,
                "sampler": "tpe", "pruner": "median", "steps_per_trial": 40},
      "params": {
        "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": true},
        "warmup_steps": {"type": "int", "low": 0, "high": 20},
        "zero_optimization.stage": {"type": "categorical", "choices": [1, 2]},
        "--dropout": {"type": "float", "low": 0.0, "high": 0.3}
      }
    }

A parameter's name says where its value goes (``substitute.py``): ``--name`` is a script argument, a dotted
name is a DeepSpeed config key path, and a few short names are aliases for the usual keys (``ALIASES``).
JSON, not YAML: the file is machine-written as often as hand-written, and JSON needs no extra dependency.
Every error is a ``SpaceError`` naming the entry (``params['lr'].low``) and what would be valid.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Scalar = bool | int | float | str | None

ALIASES: dict[str, str] = {
    "lr": "optimizer.params.lr",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "batch_size": "train_micro_batch_size_per_gpu",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}
"""Short names for the keys searched most often. ``batch_size`` is the micro-batch per rank: the trial's
``train_batch_size`` is then inferred (micro-batch x accumulation x world), as DeepSpeed infers it."""


class SpaceError(ValueError):
    """A search-space file is wrong; the message names the entry and the valid choices."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamSpace(_Strict):
    """One searched parameter: its distribution. ``float`` / ``int`` take ``low``..``high`` (inclusive), ``log``
    samples uniformly in log space, ``step`` quantizes (not with ``log``); ``categorical`` takes ``choices``."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Scalar] | None = None

    @model_validator(mode="after")
    def _check(self) -> ParamSpace:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("categorical needs a non-empty 'choices' list")
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                raise ValueError("categorical takes only 'choices' (not low/high/log/step)")
            return self
        if self.choices is not None:
            raise ValueError(f"{self.type} takes low/high, not 'choices' (use type 'categorical')")
        if self.low is None or self.high is None:
            raise ValueError(f"{self.type} needs 'low' and 'high'")
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError("low and high must be finite numbers")
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) must be <= high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError(f"log needs low > 0 (got {self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("log and step cannot be combined (Optuna refuses it)")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step must be > 0 (got {self.step:g})")
        if self.type == "int":
            for field in ("low", "high", "step"):
                value = getattr(self, field)
                if value is not None and value != int(value):
                    raise ValueError(f"int needs integral {field} (got {value:g})")
        return self


class LRRangeTestSettings(_Strict):
    """The optional first pass (``LRRangeTest``): one trial whose lr grows linearly from the ``lr`` parameter's
    low to its high over ``steps`` steps; the searched lr range is then narrowed to
    [lr_at_min_loss / ``span``, lr_at_min_loss] (inside the original range). See ``range_test.py``."""

    enabled: bool = False
    steps: int = Field(100, ge=2)
    span: float = Field(10.0, gt=1.0)
    diverge_factor: float = Field(4.0, gt=1.0)
    """The pass stops reading at the first loss above ``diverge_factor`` x the lowest loss so far (divergence)."""


class StudySettings(_Strict):
    """How the study runs. ``metric`` names the value each trial is judged by: a key of the metric JSON the
    engine writes, else of the trial's last progress record (``loss`` by default: the mean of the last
    ``metric_window`` progress losses, so one noisy step does not decide)."""

    direction: Literal["minimize", "maximize"] = "minimize"
    metric: str = "loss"
    metric_window: int = Field(3, ge=1)
    n_trials: int | None = Field(20, ge=1)
    timeout_s: float | None = Field(None, gt=0)
    seed: int | None = 0
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    n_startup_trials: int = Field(5, ge=0)
    """TPE's random trials before it models the space, and the pruner's trials before it prunes anything."""
    pruner: Literal["median", "percentile", "hyperband", "none"] = "median"
    n_warmup_steps: int = Field(5, ge=0)
    """A trial is never pruned before it reported this many steps."""
    steps_per_trial: int = Field(50, ge=2)
    """Optimizer steps per trial (the engine stops the script after this many: ``autotuning.end_profile_step``)."""
    trial_timeout_s: float = Field(600.0, gt=0)
    lr_range_test: LRRangeTestSettings = LRRangeTestSettings()


class SearchSpace(_Strict):
    study: StudySettings = StudySettings()
    params: dict[str, ParamSpace]

    @model_validator(mode="after")
    def _check_names(self) -> SearchSpace:
        if not self.params:
            raise ValueError("'params' is empty: name at least one parameter to search")
        for name in self.params:
            check_param_name(name)
        if self.study.lr_range_test.enabled:
            lr = self.params.get("lr")
            if lr is None or lr.type != "float":
                raise ValueError("study.lr_range_test needs a float parameter named 'lr'")
        return self


def check_param_name(name: str) -> None:
    """A name is a script flag (``--x``), an alias, or a dotted config path of identifier-like parts."""
    if name.startswith("--"):
        if len(name) <= 2 or "=" in name or " " in name:
            raise ValueError(f"params[{name!r}]: a script argument is written '--name' (no '=' or spaces)")
        return
    if name in ALIASES:
        return
    parts = name.split(".")
    if any(not part or not part.replace("_", "a").isalnum() for part in parts):
        raise ValueError(
            f"params[{name!r}]: not a script argument ('--name'), an alias ({', '.join(sorted(ALIASES))}) "
            "or a dotted config key path (e.g. 'optimizer.params.lr')"
        )


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = "".join(f"[{part!r}]" if isinstance(part, str) and "." in part else f".{part}" for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{where.lstrip('.') or '<file>'}: {message}")
    return "; ".join(lines)


def parse_space(raw: dict[str, Any], source: str = "search space") -> SearchSpace:
    """The typed space from a parsed JSON object; a ``SpaceError`` naming every bad entry otherwise."""
    if not isinstance(raw, dict):
        raise SpaceError(f"{source}: expected a JSON object with 'params' (and optionally 'study')")
    try:
        return SearchSpace.model_validate(raw)
    except ValidationError as error:
        raise SpaceError(f"{source}: {_describe(error)}") from None


def load_space(path: str | Path) -> SearchSpace:
    """Read and validate a search-space JSON file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        raise SpaceError(f"search space {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise SpaceError(f"search space {path}: not valid JSON: {error}") from None
    return parse_space(raw, str(path))
