"""The process-wide side of failure propagation: the board of the current default process group, the excepthooks
that publish uncaught exceptions on it, and the exit hook ([Note: failure propagation] in ``faults/board.py``).

Process-wide by nature (``sys.excepthook``, ``threading.excepthook`` and ``atexit`` are), so the board they need
lives in one slot here; the slot is replaced when the default group is (a test that destroys and re-creates it gets
a fresh board). Engines find the board through ``failure_board`` and pass it down explicitly.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.faults.board import FailureBoard, write_failure_file
from shardspeed.faults.errors import FailureRecord, PeerFailedError, is_agreed, is_published

logger = logging.getLogger("shardspeed")


class _Slot:
    """The board of the current default process group, and the process-wide hooks that need it (see the Note)."""

    def __init__(self) -> None:
        self.group: object | None = None
        self.board: FailureBoard | None = None
        self.hooks_installed = False
        self.uncaught = False


_slot = _Slot()


def failure_board(config: FaultToleranceConfig) -> FailureBoard | None:
    """The board of the default process group (created on first use), or None: propagation off, no group, or a
    world of one."""
    if not config.propagate_failures or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    group = dist.group.WORLD
    if _slot.board is None or _slot.group is not group:
        if _slot.board is not None:
            _slot.board.close()
        store = dist.distributed_c10d._get_default_store()
        _slot.board = FailureBoard(store, dist.get_rank(), dist.get_world_size(), config.watch_interval_s)
        _slot.group = group
        _install_process_hooks()
    return _slot.board


def current_failure() -> FailureRecord | None:
    """The failure recorded on this process's board, if any (the test harness and the exit hook ask)."""
    return _slot.board.failure if _slot.board is not None else None


def _publish_uncaught(exc: BaseException, where: str) -> None:
    board = _slot.board
    if board is None or isinstance(exc, (PeerFailedError, SystemExit)) or is_published(exc):
        return
    if is_agreed(exc):  # every rank raised it alike: nothing to tell the peers, but the launcher names the cause
        write_failure_file(FailureRecord.of(board.rank, where, exc))
        return
    try:
        board.publish(where, exc)
    except Exception as error:  # never let the hook itself hide the user's traceback
        logger.debug("publishing an uncaught exception failed: %s", error)


def _install_process_hooks() -> None:
    """sys.excepthook / threading.excepthook publish uncaught exceptions; atexit leaves without waiting on peers.
    Each chains to the hook it replaces."""
    if _slot.hooks_installed:
        return
    _slot.hooks_installed = True
    previous_sys = sys.excepthook
    previous_thread = threading.excepthook

    def sys_hook(kind: type[BaseException], exc: BaseException, tb: object) -> None:
        _slot.uncaught = True
        _publish_uncaught(exc, "user code (uncaught exception)")
        previous_sys(kind, exc, tb)  # type: ignore[arg-type]

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            name = args.thread.name if args.thread is not None else "?"
            _publish_uncaught(args.exc_value, f"thread {name!r} (uncaught exception)")
        previous_thread(args)

    sys.excepthook = sys_hook
    threading.excepthook = thread_hook
    atexit.register(_exit_after_failure)  # registered after init_distributed's hook, so it runs before it


def _exit_after_failure() -> None:
    """atexit: after a recorded failure, leave now — tearing the group down could wait on a dead peer forever.
    Otherwise stop the watcher first, so no store call is in flight while the process group is torn down."""
    if current_failure() is None:
        if _slot.board is not None:
            _slot.board.close(wait_s=2.0)
        return
    board = _slot.board
    if board is not None and board.published_here and board.rank == 0 and not _agent_store():
        # Rank 0's process hosts the TCPStore (env:// under SLURM, MPI, a hand-made rendezvous): leaving at once
        # would take the published failure with it before the peers' watchers read it, and they would see only a
        # closed connection. Two watch intervals (and a second) give every watcher a poll.
        time.sleep(min(2 * board.interval + 1.0, 5.0))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(1)


def _agent_store() -> bool:
    """Whether torchrun's agent hosts the store (then it outlives every rank)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
