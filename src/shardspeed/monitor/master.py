"""``MonitorMaster``: ``engine.monitor`` (DeepSpeed's name). Builds the configured monitors on the one rank that
writes, fans events out to them, and lets a user add their own.

[Note: the writing rank] Events are written on one rank: the last pipeline stage's data-rank-0 / tensor-rank-0
rank (global rank 0 without a pipeline). The last stage is where the pipeline's loss is computed (DeepSpeed's
pipeline engine writes ``train_loss`` from there); data rank 0 / tensor rank 0 picks one of its replicas. Every other
rank builds no monitor, and ``write_events`` is a no-op there, so anyone (the engine, the profiler, a script) may call
it on every rank.

[Note: monitor config agreed] Whether monitors are on decides a collective (the per-step memory gather,
monitor/listener.py), so it must be the same on every rank. ``agree_monitor_config`` runs at every engine's
``initialize()`` (one small ``all_gather_object`` over the world, always, monitors or not), right after the engine's
``Collectives`` exist and before any model state, hook or swap file: each rank sends the monitor sections it enables
and the optional packages (``tensorboard``, ``wandb``: the ``monitor`` extra) that fail to import there. Sections
that differ across ranks are one ``MonitorConfigError`` on every rank, naming the ranks and the keys; a missing
package on any host is one ``MonitorPackageError`` on every rank (naming the config key and the extra) — never an
error on the writer while its peers train on into a hang. DeepSpeed builds its monitors on rank 0 only, so a
DeepSpeed script may enable them on rank 0 only (``"enabled": rank == 0``); here that is the clear error above:
enable them on every rank, only the writing rank writes.

[Note: added monitors are local] ``engine.monitor.add(m)`` changes no collective: a user's monitor may be added on
one rank only (``if rank == 0: engine.monitor.add(m)``, DeepSpeed's rank-0 pattern). It receives events only if
that rank is the writing rank. Without a configured monitor no memory gather runs, so an added monitor gets the
``Train/Samples/*`` tags and the writing rank's own ``Memory/rank{r}/*`` figures only.
"""

from __future__ import annotations

import importlib.util
import logging
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
    "MonitorConfigError",
    "MonitorMaster",
    "MonitorPackageError",
    "agree_monitor_config",
    "is_writing_rank",
    "missing_packages",
]

_LOG = logging.getLogger("shardspeed")

MONITOR_EXTRA = "pip install shardspeed[monitor]"

PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Config section -> the package its monitor imports (the CSV monitor needs none)."""


class MonitorPackageError(ImportError):
    """A monitor is enabled but its package is missing on some rank."""


class MonitorConfigError(ValueError):
    """The ranks enable different monitor sections."""


def enabled_sections(config: ShardSpeedConfig) -> list[str]:
    """``"<section>.enabled"`` for each monitor section this rank's config enables."""
    return [f"{s}.enabled" for s in ("tensorboard", "csv_monitor", "wandb") if getattr(config, s).enabled]


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


def agree_monitor_config(config: ShardSpeedConfig, topology: Topology, collectives: Collectives) -> None:
    """[Note: monitor config agreed]: one collective over the world, always; the same error on every rank when
    the ranks enable different monitors, or an enabled monitor's package does not import on some rank."""
    mine = (enabled_sections(config), missing_packages(config))
    gathered: list = collectives.all_gather_object(mine, topology.world)  # type: ignore[assignment]
    ranks = topology.world.ranks
    if any(sections != gathered[0][0] for sections, _ in gathered):
        by_rank = "; ".join(f"rank {r}: {', '.join(g[0]) or 'none'}" for r, g in zip(ranks, gathered, strict=True))
        raise mark_agreed(
            MonitorConfigError(
                f"the ranks enable different monitors ({by_rank}); enable the same monitor sections on every rank "
                "(only the writing rank writes: DeepSpeed's '\"enabled\": rank == 0' is not needed)"
            )
        )
    problems = sorted({p for _, rank_missing in gathered for p in rank_missing})
    if problems:
        missing_on = [r for r, (_, m) in zip(ranks, gathered, strict=True) if m]
        raise mark_agreed(
            MonitorPackageError(
                f"{', '.join(problems)}: the monitor's package does not import on rank(s) "
                f"{', '.join(map(str, missing_on))}; install the monitor extra ({MONITOR_EXTRA}) or set "
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
        """The config enables a monitor: the same on every rank ([Note: monitor config agreed]); it alone decides
        the per-step memory gather."""
        self.tokens_per_sample: int | None = None
        """Override the tokens per sample the step listener infers (monitor/listener.py); None: inferred."""
        self.listener: Any = None
        """The engine's ``MonitorListener`` (monitor/listener.py), when an engine built this master."""
        self._closed = False
        self._failed: set[int] = set()  # ids of monitors whose write failed once (warned, then skipped)

    @classmethod
    def from_config(cls, config: ShardSpeedConfig, topology: Topology) -> MonitorMaster:
        """The configured monitors (on the writing rank). The engine ran ``agree_monitor_config`` first."""
        configured = any_monitor_enabled(config.tensorboard, config.csv_monitor, config.wandb)
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

    def add(self, monitor: Monitor) -> None:
        """Add a user's monitor, on any rank or ranks ([Note: added monitors are local]): it is kept, and written
        to, on the writing rank only; no collective starts or stops."""
        if not isinstance(monitor, Monitor):
            raise TypeError(f"engine.monitor.add expects a shardspeed.monitor.Monitor, got {type(monitor).__name__}")
        if self.writes:
            self.monitors.append(monitor)

    def write_events(self, events: Sequence[Event]) -> None:
        """Every monitor gets the events; one that raises is warned about once and skipped from then on, so a full
        disk under the CSV files neither starves TensorBoard / W&B nor stops training on the writer alone."""
        if not self.writes or not events:
            return
        for monitor in self.monitors:
            if id(monitor) in self._failed:
                continue
            try:
                monitor.write_events(events)
            except Exception as err:
                self._failed.add(id(monitor))
                _LOG.warning(
                    "monitor %s failed to write (%s: %s); it gets no more events",
                    _name(monitor),
                    type(err).__name__,
                    err,
                )

    def flush(self) -> None:
        for monitor in self.monitors:
            monitor.flush()

    def close(self, *, peer_failed: bool = False) -> None:
        """Close every monitor once (each flushes first); ``engine.destroy()`` calls it, after the rest of its
        cleanup. ``peer_failed``: a failure is known, so the last step's memory gather (which a failed peer may
        never join) is not waited. Never raises: an error closing one monitor is a warning, the others still
        close."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.listener is not None:
                # every rank: the last step's gather is waited and its events written (skipped after a failure)
                self.listener.finish(wait=not peer_failed)
        except Exception as err:  # a peer failed while we waited: the figures are lost, the files are not
            _LOG.warning("the last step's memory figures were not written (%s: %s)", type(err).__name__, err)
        finally:
            if self.listener is not None:
                self.listener.detach()
            for monitor in self.monitors:
                try:
                    monitor.close()
                except Exception as err:
                    _LOG.warning("monitor %s failed to close (%s: %s)", _name(monitor), type(err).__name__, err)


def _name(monitor: Monitor) -> str:
    return type(monitor).__name__
