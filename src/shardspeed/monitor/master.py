"""``MonitorMaster``: ``engine.monitor`` (DeepSpeed's name). Builds the configured monitors on the one rank that
writes, fans events out to them, and lets a user add their own.

[Note: the writing rank] Events are written on one rank: the last pipeline stage's data-rank-0 / tensor-rank-0
rank (global rank 0 without a pipeline). The last stage is where the pipeline's loss is computed (DeepSpeed's
pipeline engine writes ``train_loss`` from there); data rank 0 / tensor rank 0 picks one of its replicas. Every other
rank builds no monitor, and ``write_events`` is a no-op there, so anyone (the engine, the profiler, a script) may call
it on every rank.

[Note: monitor packages agreed] ``tensorboard`` and ``wandb`` are optional (the ``monitor`` extra). Whether they
import is checked on *every* rank and all-gathered over the world before any monitor is built, so a missing package
on any host is the same ``MonitorPackageError`` on every rank (naming the config key and the extra) at
``initialize()``, never an error on the writer while its peers train on into a hang. The engine checks right after
building its ``Collectives``, before any model state, hook or swap file exists.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from shardspeed.comm import Collectives
from shardspeed.config import ShardSpeedConfig
from shardspeed.config.monitor import any_monitor_enabled
from shardspeed.faults.errors import mark_agreed
from shardspeed.topology import Topology

from .base import Event, Monitor
from .writers import CsvMonitor, TensorBoardMonitor, WandbMonitor

__all__ = [
    "MONITOR_EXTRA",
    "MonitorMaster",
    "MonitorPackageError",
    "agree_monitor_packages",
    "is_writing_rank",
    "missing_packages",
]

MONITOR_EXTRA = "pip install shardspeed[monitor]"

PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Config section -> the package its monitor imports (the CSV monitor needs none)."""


class MonitorPackageError(ImportError):
    """A monitor is enabled but its package is missing on some rank."""


def missing_packages(config: ShardSpeedConfig) -> list[str]:
    """``"<section>.enabled"`` for each enabled monitor whose package does not import on this rank."""
    missing = []
    for section, package in PACKAGES.items():
        if getattr(config, section).enabled and not _importable(package):
            missing.append(f"{section}.enabled ({package})")
    return missing


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or a module stubbed out as None in sys.modules
        return False


def agree_monitor_packages(config: ShardSpeedConfig, topology: Topology, collectives: Collectives) -> None:
    """[Note: monitor packages agreed]: one ``MonitorPackageError`` on every rank when an enabled monitor's package
    does not import on any rank. Collective over the world when a monitor is enabled; nothing otherwise."""
    if not any_monitor_enabled(config.tensorboard, config.csv_monitor, config.wandb):
        return
    gathered = collectives.all_gather_object(missing_packages(config), topology.world)
    problems = sorted({p for rank_missing in gathered for p in rank_missing})  # type: ignore[attr-defined]
    if problems:
        ranks = [topology.world.ranks[i] for i, m in enumerate(gathered) if m]
        raise mark_agreed(
            MonitorPackageError(
                f"{', '.join(problems)}: the monitor's package does not import on rank(s) "
                f"{', '.join(map(str, ranks))}; install the monitor extra ({MONITOR_EXTRA}) or set "
                f'"enabled": false'
            )
        )


def is_writing_rank(topology: Topology) -> bool:
    """[Note: the writing rank]."""
    pipe, data, tensor = topology.pipe, topology.data, topology.tensor
    return pipe.rank == pipe.size - 1 and data.rank == 0 and tensor.rank == 0


class MonitorMaster(Monitor):
    """``engine.monitor``. ``enabled``: any monitor (configured or added) and this rank writes."""

    def __init__(self, monitors: Sequence[Monitor], writes: bool, configured: bool) -> None:
        self.writes = writes
        """Whether this rank is the writing rank ([Note: the writing rank])."""
        self.monitors: list[Monitor] = list(monitors) if writes else []
        self.configured = configured
        """The config enables a monitor (the same on every rank)."""
        self.added = False
        self.tokens_per_sample: int | None = None
        """Override the tokens per sample the step listener infers (monitor/listener.py); None: inferred."""
        self.listener: Any = None
        """The engine's ``MonitorListener`` (monitor/listener.py), when an engine built this master."""
        self._closed = False

    @classmethod
    def from_config(
        cls, config: ShardSpeedConfig, topology: Topology, collectives: Collectives, *, packages_agreed: bool = False
    ) -> MonitorMaster:
        """The configured monitors (on the writing rank); ``agree_monitor_packages`` first (a collective over the
        world when a monitor is enabled) unless the caller did (``packages_agreed``)."""
        configured = any_monitor_enabled(config.tensorboard, config.csv_monitor, config.wandb)
        if not packages_agreed:
            agree_monitor_packages(config, topology, collectives)
        writes = is_writing_rank(topology)
        monitors: list[Monitor] = []
        if configured and writes:
            if config.csv_monitor.enabled:
                monitors.append(CsvMonitor(config.csv_monitor))
            if config.tensorboard.enabled:
                monitors.append(TensorBoardMonitor(config.tensorboard))
            if config.wandb.enabled:
                monitors.append(WandbMonitor(config.wandb))
        return cls(monitors, writes, configured)

    @property
    def enabled(self) -> bool:
        return self.writes and bool(self.monitors)

    @property
    def active(self) -> bool:
        """Whether the engine's listener produces events: the same on every rank as long as ``add`` is called on
        every rank (it decides the per-step memory gather, a collective)."""
        return self.configured or self.added

    def add(self, monitor: Monitor) -> None:
        """Add a user's monitor. Call it on every rank, like every engine call (the per-step memory gather starts
        with it); the monitor is kept, and written to, on the writing rank only."""
        if not isinstance(monitor, Monitor):
            raise TypeError(f"engine.monitor.add expects a shardspeed.monitor.Monitor, got {type(monitor).__name__}")
        self.added = True
        if self.writes:
            self.monitors.append(monitor)
        if self.listener is not None:
            self.listener.activate()

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.writes or not events:
            return
        for monitor in self.monitors:
            monitor.write_events(events)

    def flush(self) -> None:
        for monitor in self.monitors:
            monitor.flush()

    def close(self) -> None:
        """Close every monitor once (each flushes first); ``engine.destroy()`` calls it."""
        if self._closed:
            return
        self._closed = True
        if self.listener is not None:
            self.listener.finish()  # every rank: the last step's memory gather is waited, its events written
            self.listener.detach()
        for monitor in self.monitors:
            monitor.close()
