"""Small sections: ``optimizer``, ``scheduler`` and ``comms_logger``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from .base import ConfigModel

NonEmptyStr = Annotated[str, Field(min_length=1)]


class OptimizerConfig(ConfigModel):
    """``optimizer``: which optimizer the engine builds when the caller passes none.

    ``params`` is checked by ``shardspeed.optim.validate_optimizer_params`` (the optimizer module knows
    each optimizer's arguments); ``load_config`` stores its validated result here.
    """

    type: NonEmptyStr
    """Optimizer name as the user spelled it, e.g. "AdamW" (matching is the optimizer module's job).
    DeepSpeed default: none (no optimizer section means the caller supplies the optimizer)."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments, e.g. ``{"lr": 1e-3, "betas": [0.9, 0.999]}``. DeepSpeed default: {}."""

    @field_validator("params", mode="before")
    @classmethod
    def _null_params_are_empty(cls, params: Any) -> Any:
        return {} if params is None else params


class SchedulerConfig(ConfigModel):
    """``scheduler``: which learning-rate schedule the engine builds when the caller passes none.

    ``params`` is checked by ``shardspeed.schedulers.validate_scheduler_params``.
    """

    type: NonEmptyStr
    """Schedule name as the user spelled it, e.g. "WarmupDecayLR". DeepSpeed default: none."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Schedule arguments, e.g. ``{"warmup_num_steps": 100}``. DeepSpeed default: {}."""

    @field_validator("params", mode="before")
    @classmethod
    def _null_params_are_empty(cls, params: Any) -> Any:
        return {} if params is None else params


class CommsLoggerConfig(ConfigModel):
    """``comms_logger``: record every collective the engine issues: calls, bytes, launch-to-completion latency and
    bandwidths per op and tag (comm/log.py; nothing is synchronised to time it, unlike DeepSpeed)."""

    enabled: bool = False
    """Log communication operations. DeepSpeed default: false."""

    verbose: bool = False
    """Print each operation as it completes, not only in the summary. DeepSpeed default: false."""

    prof_all: bool = True
    """Profile every operation; when false, only those named in ``prof_ops``. DeepSpeed default: true."""

    debug: bool = False
    """Append the calling function's name to each logged operation. DeepSpeed default: false."""

    prof_ops: list[str] = Field(default_factory=list)
    """Operations to profile when ``prof_all`` is false, e.g. ``["all_reduce"]``. DeepSpeed default: []."""
