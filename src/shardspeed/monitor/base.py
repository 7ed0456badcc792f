"""The monitor interface: a ``Monitor`` receives events, ``(tag, value, x)`` triples, and writes them somewhere.

DeepSpeed's shape (``deepspeed/monitor/monitor.py``): ``write_events(event_list)``; ours adds ``flush()`` and
``close()`` so the engine can make sure nothing is lost when it is destroyed. A user's own monitor subclasses
``Monitor`` and is added with ``engine.monitor.add(...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Event", "Monitor"]

Event = tuple[str, float, int]
"""``(tag, value, x)``: e.g. ``("Train/Samples/train_loss", 2.31, 4096)``; x is the global sample count."""


class Monitor:
    """Base class of every monitor. ``write_events`` must be implemented; ``flush`` / ``close`` default to no-ops."""

    def write_events(self, events: Sequence[Event]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.write_events")

    def flush(self) -> None:
        """Make everything written so far durable (readable by another process)."""

    def close(self) -> None:
        """Flush and release files / runs. Called once, by ``engine.destroy()`` (through ``MonitorMaster``)."""
        self.flush()
