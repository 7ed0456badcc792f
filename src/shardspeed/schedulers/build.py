"""Validate the ``scheduler`` config section and build the LR scheduler (from config or from the user).

Two sources: a config ``scheduler`` section, or a client scheduler passed to ``initialize()`` (an instance, or a
callable ``(optimizer) -> scheduler`` for when the engine's optimizer only exists inside ``initialize``). Neither
means no scheduler (None).

Both at once: the client's wins and the config section is not built, as in DeepSpeed 0.19
(``DeepSpeedEngine._configure_lr_scheduler`` checks ``client_lr_scheduler`` first and builds from the config only
without one; DeepSpeed before ~0.10 did the opposite). DeepSpeed says so in an info line ("DeepSpeed using client
LR scheduler"); shardspeed logs one warning naming both, like the client-optimizer rule in optim/build.py, because a
config section that is silently not used is exactly the surprise this project's config tables exist to prevent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardspeed.config.errors import ConfigError, did_you_mean
from shardspeed.log import logger
from shardspeed.optim.param_checks import ParamSpec, validate_params
from shardspeed.schedulers.base import BatchLRScheduler
from shardspeed.schedulers.cosine import WARMUP_COSINE_LR_SPEC, WarmupCosineLR
from shardspeed.schedulers.one_cycle import ONE_CYCLE_SPEC, OneCycle
from shardspeed.schedulers.range_test import LR_RANGE_TEST_SPEC, LRRangeTest
from shardspeed.schedulers.warmup import (
    WARMUP_DECAY_LR_SPEC,
    WARMUP_LR_SPEC,
    WarmupDecayLR,
    WarmupLR,
)

SCHEDULERS: dict[str, tuple[type[BatchLRScheduler], dict[str, ParamSpec]]] = {
    "WarmupLR": (WarmupLR, WARMUP_LR_SPEC),
    "WarmupDecayLR": (WarmupDecayLR, WARMUP_DECAY_LR_SPEC),
    "WarmupCosineLR": (WarmupCosineLR, WARMUP_COSINE_LR_SPEC),
    "OneCycle": (OneCycle, ONE_CYCLE_SPEC),
    "LRRangeTest": (LRRangeTest, LR_RANGE_TEST_SPEC),
}
"""DeepSpeed's schedule names -> (class, accepted params)."""

UserScheduler = Any | Callable[[torch.optim.Optimizer], Any]


def canonical_scheduler_name(type_name: object, path: str = "scheduler.type") -> str:
    """The canonical spelling of a ``scheduler.type`` (matched case-insensitively), or ConfigError."""
    if isinstance(type_name, str):
        for name in SCHEDULERS:
            if name.lower() == type_name.lower():
                return name
        hint = did_you_mean(type_name, SCHEDULERS)
    else:
        hint = ""
    raise ConfigError(f"{path} {type_name!r} is not a known LR schedule{hint}; valid types: {', '.join(SCHEDULERS)}")


def validate_scheduler_params(type_name: str, params: dict[str, Any], path: str = "scheduler.params") -> dict:
    """Check ``params`` for schedule ``type_name``; return them with DeepSpeed's defaults filled in.

    Unknown keys (with the nearest valid one), wrong kinds, negative or zero step counts, ratios outside
    [0, 1] and missing required keys (``total_num_steps``; ``cycle_min_lr``/``cycle_max_lr``) raise
    ConfigError naming ``f"{path}.{key}"``. ``warmup_max_lr`` stays absent when absent (it then follows the
    optimizer's lr at build time). Validating an already-normalized dict returns it unchanged.
    """
    type_path = path[: -len(".params")] + ".type" if path.endswith(".params") else f"{path}.type"
    name = canonical_scheduler_name(type_name, type_path)
    # A schedule that ends before its warmup does is only warned about (as DeepSpeed does), by the class
    # when it is built: warning here too would repeat it, since the engine validates again at build time.
    return validate_params(params, SCHEDULERS[name][1], path)


def _looks_like_scheduler(candidate: object) -> bool:
    return not isinstance(candidate, type) and callable(getattr(candidate, "step", None))


def build_scheduler(
    cfg_type: str | None,
    params: Mapping[str, Any] | None,
    optimizer: torch.optim.Optimizer,
    user_scheduler: UserScheduler | None = None,
) -> Any | None:
    """The LR scheduler for ``optimizer``: from the config, from the user, or None when there is neither.

    ``user_scheduler`` may be a scheduler instance (anything with ``step()``, e.g. a torch LRScheduler) —
    returned as is — or a callable (including a class) taking the optimizer and returning one.
    """
    if user_scheduler is not None:
        if cfg_type is not None:
            client = "a callable" if not _looks_like_scheduler(user_scheduler) else type(user_scheduler).__name__
            logger.warning(
                f"both a client LR scheduler ({client}, passed to initialize()) and a config scheduler "
                f'("scheduler.type": "{cfg_type}") were given; using the client scheduler and ignoring the '
                "config's, as DeepSpeed does"
            )
        if _looks_like_scheduler(user_scheduler):
            return user_scheduler
        if callable(user_scheduler):
            built = user_scheduler(optimizer)
            if not callable(getattr(built, "step", None)):
                raise TypeError(f"the lr_scheduler callable returned {type(built).__name__}, which has no step()")
            return built
        raise TypeError(
            "lr_scheduler must be a scheduler (with step()) or a callable (optimizer) -> scheduler, "
            f"got {type(user_scheduler).__name__}"
        )
    if cfg_type is None:
        return None
    name = canonical_scheduler_name(cfg_type)
    cls, _ = SCHEDULERS[name]
    return cls(optimizer, **validate_scheduler_params(name, dict(params or {})))
