"""DeepSpeed's ``deepspeed.utils.logging``: the library logger and ``log_dist`` (log on chosen ranks only).

``logger`` is shardspeed's own logger (``logging.getLogger("shardspeed")``), configured as the engine configures
it: one stderr handler, INFO on rank 0 and WARNING elsewhere (``shardspeed.log``). ``log_dist`` picks ranks
explicitly, so it logs through a child logger that is enabled at every level: ``log_dist(msg, ranks=[1])``
reaches the handler on rank 1 even though the library logger is quiet there.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from shardspeed.log import configure_logger

logger = configure_logger(int(os.environ.get("RANK", "0")))
_log_dist_logger = logging.getLogger("shardspeed.log_dist")
_log_dist_logger.setLevel(logging.DEBUG)  # the ranks argument is the filter, not the rank-dependent level

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _should_log(ranks: list[int] | None) -> tuple[bool, int]:
    """DeepSpeed's rule: always without a process group; else when this rank is in ``ranks`` or ranks is [-1]."""
    if not (dist.is_available() and dist.is_initialized()):
        return True, -1
    rank = dist.get_rank()
    ranks = list(ranks or [])
    return bool(ranks) and (ranks[0] == -1 or rank in ranks), rank


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` as ``[Rank r] message`` on the ranks in ``ranks`` (``[-1]``: all ranks; ``None``: none once
    a process group exists — DeepSpeed's rule)."""
    should_log, rank = _should_log(ranks)
    if should_log:
        _log_dist_logger.log(level, "[Rank %d] %s", rank, message)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when the logger's level is at or below the named level ("info": INFO or DEBUG is set)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str!r} is not a string")
    name = max_log_level_str.lower()
    if name not in log_levels:
        raise ValueError(f"{max_log_level_str!r} is not one of the logging levels {sorted(log_levels)}")
    return get_current_level() <= log_levels[name]


__all__ = ["get_current_level", "log_dist", "log_levels", "logger", "should_log_le"]
