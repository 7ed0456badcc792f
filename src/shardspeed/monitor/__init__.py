"""Monitors (DeepSpeed's ``deepspeed.monitor``): TensorBoard, CSV and W&B writers of training scalars, and
``MonitorMaster`` (``engine.monitor``), which builds them on the writing rank and fans events out.

``Monitor`` is the interface (``write_events``, ``flush``, ``close``); ``Event`` is ``(tag, value, x)``.
What is written each step: ``tags.step_events``; who writes: [Note: the writing rank] in ``master.py``.
"""

from .base import Event, Monitor
from .master import MONITOR_EXTRA, MonitorMaster, MonitorPackageError
from .writers import CsvMonitor, TensorBoardMonitor, WandbMonitor

__all__ = [
    "MONITOR_EXTRA",
    "CsvMonitor",
    "Event",
    "Monitor",
    "MonitorMaster",
    "MonitorPackageError",
    "TensorBoardMonitor",
    "WandbMonitor",
]
