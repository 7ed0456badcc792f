"""The library's logger: INFO on data-parallel rank 0, WARNING elsewhere, so logs are not repeated N times."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("shardspeed")


def configure_logger(rank: int) -> logging.Logger:
    """Attach a stderr handler once (unless the application configured the logger itself)."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[shardspeed rank{rank}] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger
