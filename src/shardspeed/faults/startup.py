"""What failure propagation needs before the config is parsed: the process-group timeout.

``initialize`` must create the process group before it can parse the config (batch sizes depend on the
data-parallel world size), but the group's timeout is a config field (``fault_tolerance.collective_timeout_s``).
So that one section is read from the raw config first; anything wrong with it is left for ``load_config`` to
report with its usual message (here it only falls back to the defaults).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from shardspeed.config.fault_tolerance import FaultToleranceConfig

GLOO_TIMEOUT_S = 600.0  # CPU: a collective whose peer never comes fails after 10 minutes, not torch's 30
NCCL_TIMEOUT_S = 1800.0  # CUDA: torch's (and DeepSpeed's) default


def default_timeout(backend: str) -> timedelta:
    """The process-group timeout when neither the config nor ``init_distributed(timeout=)`` names one."""
    return timedelta(seconds=NCCL_TIMEOUT_S if backend == "nccl" else GLOO_TIMEOUT_S)


def early_fault_config(config: Any) -> FaultToleranceConfig:
    """The ``fault_tolerance`` section of a raw config (dict or JSON path), or the defaults if it cannot be read
    yet (``load_config`` then reports the problem properly)."""
    from shardspeed.config.load import read_config_source

    try:
        section = read_config_source(config).get("fault_tolerance") or {}
        return FaultToleranceConfig.model_validate(section)
    except Exception:
        return FaultToleranceConfig()


def configured_timeout(config: FaultToleranceConfig) -> timedelta | None:
    """``collective_timeout_s`` as a timedelta (None: the backend's default)."""
    seconds = config.collective_timeout_s
    return timedelta(seconds=seconds) if seconds is not None else None
