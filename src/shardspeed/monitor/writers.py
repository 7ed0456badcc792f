"""The three built-in monitors: CSV (DeepSpeed's file layout), TensorBoard (the ``tensorboard`` package's writer)
and W&B. Each is built only on the writing rank (``MonitorMaster``); the optional packages are imported here,
inside the constructors, so shardspeed imports without the ``monitor`` extra.

[Note: monitors never lose the last events] ``close()`` (``engine.destroy()``) flushes and closes every monitor.
Before that, a crash mid-run leaves readable files: the CSV monitor flushes at the end of every ``write_events``
(the files hold every step written so far, as DeepSpeed's, which re-opens its files per event); the TensorBoard
event file is written and flushed by tensorboard's ``EventFileWriter`` thread every ``TENSORBOARD_FLUSH_SECS``
(a crash loses at most that much; DeepSpeed flushes on the training thread per call, which cost ~1-4 ms a step in the
monitor benchmark, waiting for that thread); ``engine.monitor.flush()`` forces it. W&B's events go through our
writer thread to W&B's own service; ``close()`` drains the thread and finishes the run, which completes its files
(``WANDB_MODE=offline``: under ``./wandb`` or ``$WANDB_DIR``).
"""

from __future__ import annotations

import atexit
import csv
import os
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from shardspeed.config.monitor import CsvMonitorConfig, TensorBoardConfig, WandbConfig

from .base import Event, Monitor

__all__ = ["CsvMonitor", "TensorBoardMonitor", "WandbMonitor", "csv_file_name", "csv_header"]

TENSORBOARD_FLUSH_SECS = 2
"""How often tensorboard's writer thread flushes the event file ([Note: monitors never lose the last events])."""


def job_dir(output_path: str, job_name: str) -> Path:
    """DeepSpeed's ``os.path.join(output_path, job_name)`` (``output_path`` "" = the launch directory)."""
    return Path(os.path.join(output_path, job_name))


def csv_file_name(tag: str) -> str:
    """DeepSpeed's csv_monitor rule: the tag with every ``/`` and space replaced by ``_``, plus ``.csv``."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


def csv_header(tag: str) -> list[str]:
    """DeepSpeed's csv_monitor header row: ``step`` and the tag's last ``/``-separated component."""
    return ["step", tag.split("/")[-1]]


class CsvMonitor(Monitor):
    """``csv_monitor``: one file per tag under ``{output_path}/{job_name}/``, rows ``x,value`` after the header.

    Differs from DeepSpeed in one way: the header is written when the file is new or empty, so a resumed run
    appending to the same directory keeps one header per file (DeepSpeed writes it again per process)."""

    def __init__(self, config: CsvMonitorConfig) -> None:
        self.log_dir = job_dir(config.output_path, config.job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[IO[str], Any]] = {}

    def _writer(self, tag: str) -> Any:
        entry = self._files.get(tag)
        if entry is None:
            path = self.log_dir / csv_file_name(tag)
            handle = open(path, "a", newline="")  # noqa: SIM115 -- kept open across steps, closed in close()
            writer = csv.writer(handle)
            if handle.tell() == 0:
                writer.writerow(csv_header(tag))
            entry = self._files[tag] = (handle, writer)
        return entry[1]

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, x in events:
            self._writer(tag).writerow([x, value])
        self.flush()  # [Note: monitors never lose the last events]

    def flush(self) -> None:
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


class TensorBoardMonitor(Monitor):
    """``tensorboard``: scalars in ``{output_path}/{job_name}/``, step = x, through the ``tensorboard`` package's
    own ``EventFileWriter`` (the writer ``torch.utils.tensorboard.SummaryWriter`` wraps).

    One event per x holding all of that x's scalars (``simple_value``, float32, as ``add_scalar`` writes them),
    rather than ``SummaryWriter.add_scalar``'s one event per scalar: the same file for tensorboard's readers, at a
    tenth of the cost (``add_scalar`` spends ~80 us per scalar converting and checking its argument; measured for
    the monitor benchmark)."""

    def __init__(self, config: TensorBoardConfig) -> None:
        # the monitor extra's tensorboard package
        from tensorboard.compat.proto.event_pb2 import Event as TbEvent
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = job_dir(config.output_path, config.job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._event, self._summary = TbEvent, Summary
        # the writer's own thread writes the queue and flushes every FLUSH_SECS: [Note: monitors never lose ...]
        self.writer: Any = EventFileWriter(str(self.log_dir), flush_secs=TENSORBOARD_FLUSH_SECS)
        _close_at_exit(self)  # a script that never calls engine.destroy() still gets its queued events written

    def write_events(self, events: Sequence[Event]) -> None:
        if self.writer is None:
            return
        by_x: dict[int, list[Any]] = {}
        for tag, value, x in events:
            by_x.setdefault(int(x), []).append(self._summary.Value(tag=tag, simple_value=float(value)))
        now = time.time()
        for x, values in by_x.items():  # queued; written and flushed by the writer's thread
            self.writer.add_event(self._event(wall_time=now, step=x, summary=self._summary(value=values)))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _close_at_exit(monitor: Monitor) -> None:
    """Close ``monitor`` at interpreter exit unless it was closed (or collected) before."""
    ref = weakref.ref(monitor)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    atexit.register(close)


class WandbMonitor(Monitor):
    """``wandb``: ``wandb.init(project=, entity=team, group=)``; each x's events in one ``run.log(..., step=x)``.

    ``run.log`` costs ~2 ms a call on the CPU (its serialization and the hand-off to W&B's service), more than
    every other monitor together (the monitor benchmark), so calls are made by one writer thread fed through a
    queue: the training thread only enqueues. ``flush()`` waits for the queue to drain; ``close()`` drains it,
    stops the thread and finishes the run."""

    def __init__(self, config: WandbConfig) -> None:
        import wandb  # the monitor extra; WANDB_MODE / WANDB_DIR are read by wandb itself

        self.run: Any = wandb.init(project=config.project, entity=config.team, group=config.group)
        self._queue: queue.Queue[list[Event] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="shardspeed-wandb-monitor", daemon=True)
        self._thread.start()
        _close_at_exit(self)

    def _drain(self) -> None:
        while True:
            events = self._queue.get()
            try:
                if events is None:
                    return
                if self._error is None:
                    self._log(events)
            except BaseException as err:  # kept, and raised on the training thread at the next call
                self._error = err
            finally:
                self._queue.task_done()

    def _log(self, events: Sequence[Event]) -> None:
        by_x: dict[int, dict[str, float]] = {}
        for tag, value, x in events:
            by_x.setdefault(x, {})[tag] = value
        for x in sorted(by_x):  # W&B steps must not decrease
            self.run.log(by_x[x], step=x)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the W&B monitor failed to log: {error}") from error

    def write_events(self, events: Sequence[Event]) -> None:
        if self.run is None:
            return
        self._raise_error()
        self._queue.put(list(events))

    def flush(self) -> None:
        if self.run is not None:
            self._queue.join()
            self._raise_error()

    def close(self) -> None:
        if self.run is None:
            return
        self._queue.put(None)
        self._thread.join()
        run, self.run = self.run, None
        run.finish()
        self._raise_error()
