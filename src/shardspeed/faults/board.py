"""The failure board: where a failing rank says so, and where every other rank looks while it waits.

[Note: failure propagation] gloo cannot be woken from inside: ``abort()`` does not interrupt an all-reduce whose
peer never arrives (measured, torch 2.13). So no rank ever waits *inside* gloo. Every wait of the library's
collectives (``comm/collectives.py``: synchronous calls are issued async and waited here; ``Work.wait()`` too)
goes through ``FailureBoard.wait``: a ``threading.Event`` set by the work's future callback *or* by the board's
watcher thread, whichever comes first (as fast as a plain synchronous collective: benchmarks/bench_fault_wait.py).

- An engine call that raises on one rank publishes an *origin* failure (``faults/guard.py``): ``add("seq", 1)``
  numbers it (so "first" is well defined), ``set("failure/<seq>", json)`` records it. An exception uncaught in the
  script (``sys.excepthook``, ``threading.excepthook``) is published the same way.
- Each rank's watcher (a daemon thread) polls ``check(["failure/1"])`` every ``watch_interval_s`` (a read: no
  write, no collective); on a failure it records it and wakes every waiter, which raises ``PeerFailedError`` naming
  the failing rank, its exception and what this rank was waiting in. The next engine call raises too.
- A rank raising ``PeerFailedError`` publishes nothing (only origins are published).
- A peer killed with SIGKILL publishes nothing; gloo reports "Connection closed by peer" to whoever talks to it.
  That rank looks which peer is gone (each rank left its host and pid on the board), publishes the death on its
  behalf (so ranks not connected to it wake too) and raises ``PeerDiedError``. Ranks that talk to nobody find out
  at the latest after the process-group timeout (``fault_tolerance.collective_timeout_s``).
- Agreed errors (raised identically on every rank after a symmetric check) are not failures: ``faults/errors.py``.
- NCCL: ``wait()`` does not block the host there, so the board only checks for a published failure before it;
  a hang shows up in a later host sync and ends at the process-group timeout (not tested here: CPU only).
- Exit: a process that leaves the interpreter with a gloo op still pending blocks until its peers exit and then
  aborts. So once a failure was recorded, the atexit hook flushes stdio and ``os._exit(1)``s instead of tearing the
  process group down ([Note: clean exit] in ``distributed.py``).

One board per default process group, on its store (``PrefixStore("shardspeed/faults/attempt_<n>/")``, per
torchrun restart attempt): engines built in one script share it, a failure in one fails them all (they share the
ranks). ``faults/process.py`` keeps it in a process-wide slot, with the excepthooks and the exit hook.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from shardspeed.faults.errors import (
    DIED,
    FailureRecord,
    PeerDiedError,
    PeerFailedError,
    mark_published,
)

logger = logging.getLogger("shardspeed")

FAILURE_DIR_ENV = "SHARDSPEED_FAILURE_DIR"
_PREFIX = "shardspeed/faults/"
_FIRST = "failure/1"
_PUBLISHED_GRACE_S = 2.0  # after a connection error: how long to look for the failure the dead peer published


class FailureBoard:
    """Failures published on the default group's store, watched by a daemon thread; interruptible waits."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, watch_interval_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval = watch_interval_s
        # Per restart attempt: torchrun's agent store outlives an attempt, and a restarted rank must not find the
        # previous attempt's failure (distributed.py does the same for the group's own keys).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = dist.PrefixStore(f"{_PREFIX}attempt_{attempt}/", store)
        self.published_here = False  # this rank published an origin failure (the exit hook may linger for it)
        self._lock = threading.Lock()
        self._failure: FailureRecord | None = None
        self._waiters: set[threading.Event] = set()
        self._stop = threading.Event()
        self.abandoned = 0  # collectives left pending because a peer failed (they can never finish)
        # NCCL's wait() only orders the current stream after the work: it never blocks the host, so waiting on the
        # host here would serialize every overlap for nothing. NCCL waits only check the board first; its own
        # watchdog (the process-group timeout) ends a collective whose peer never comes.
        self._host_waits = dist.get_backend() != "nccl"
        self._helper_queue: queue.SimpleQueue | None = None
        _remove_own_failure_file(rank)  # a record from an earlier restart attempt is not this attempt's failure
        self._store.set(f"proc/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._watcher = threading.Thread(target=self._watch, name=f"shardspeed-failure-watch-{rank}", daemon=True)
        self._watcher.start()

    # --- state ---------------------------------------------------------------------------------------------------
    @property
    def failure(self) -> FailureRecord | None:
        """The first failure this rank learned of (its own or a peer's), or None."""
        return self._failure

    def _record(self, record: FailureRecord) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = record
            waiters = list(self._waiters)
        for event in waiters:
            event.set()

    def raise_if_failed(self, doing: str) -> None:
        if self._failure is not None:
            raise PeerFailedError(self._failure, doing)

    # --- publishing ----------------------------------------------------------------------------------------------
    def publish(self, where: str, exc: BaseException) -> FailureRecord:
        """Publish an origin failure of this rank (and write ``$SHARDSPEED_FAILURE_DIR/rank<R>.json``)."""
        record = FailureRecord.of(self.rank, where, exc)
        self.published_here = True
        mark_published(exc)
        self._record(record)
        self._post(record)
        write_failure_file(record)
        return record

    def _post(self, record: FailureRecord) -> None:
        try:
            seq = self._store.add("seq", 1)
            self._store.set(f"failure/{seq}", record.to_json())
        except Exception as error:  # the store's host is gone: the peers learn from their own connection errors
            logger.warning("could not publish the failure of rank %d on the store: %s", record.rank, error)

    def _read_first(self) -> FailureRecord | None:
        if not self._store.check([_FIRST]):
            return None
        return FailureRecord.from_json(self._store.get(_FIRST))

    # --- watching ------------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                record = self._read_first()
            except Exception:  # the store went away (its host exited): collectives report their own errors
                return
            if record is not None:
                self._record(record)
                return

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the watcher (waiting up to ``wait_s`` for it: a store call in flight finishes first)."""
        self._stop.set()
        if wait_s > 0 and self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join(wait_s)

    # --- waiting -------------------------------------------------------------------------------------------------
    def wait(self, handle: dist.Work, doing: Callable[[], str]) -> None:
        """``handle.wait()``, but raise ``PeerFailedError`` as soon as a failure is published, and turn a
        connection error into one naming the peer that died. ``doing()`` says what this rank was waiting in; it is
        called only for an error (every collective of the library waits here: no message is built on success)."""
        if self._failure is not None:
            raise PeerFailedError(self._failure, doing())
        helper: _Pending | None = None
        if self._host_waits and not handle.is_completed():
            event = threading.Event()
            try:
                handle.get_future().add_done_callback(lambda _future: event.set())
            except RuntimeError:  # gloo's reduce_scatter has no future and progresses only inside wait()
                helper = _Pending(event)
                self._helper().put((handle, helper))
            with self._lock:
                self._waiters.add(event)
            try:
                # The future (or the watcher) sets the event; the timeout only re-reads the failure as a backstop.
                while not event.wait(self.interval) and self._failure is None:
                    pass
            finally:
                with self._lock:
                    self._waiters.discard(event)
            if not (helper.done if helper is not None else handle.is_completed()):
                self.abandoned += 1
                self.raise_if_failed(doing())
        try:
            if helper is None:
                handle.wait()
            elif helper.error is not None:
                raise helper.error
        except RuntimeError as error:
            raise self._communication_error(error, doing()) from error
        # A collective that completed returns its result even if a failure was published meanwhile: ranks that
        # raise together after an agreement (step_core's checks) then raise their own error, not the first one's.

    def _helper(self) -> queue.SimpleQueue:
        """The queue of a daemon thread that waits for future-less works in order (started on first use; a
        daemon so that a wait that never ends cannot hold the interpreter at exit)."""
        if self._helper_queue is None:
            self._helper_queue = queue.SimpleQueue()
            threading.Thread(
                target=_wait_in_order, args=(self._helper_queue,), name=f"shardspeed-wait-{self.rank}", daemon=True
            ).start()
        return self._helper_queue

    def _communication_error(self, error: RuntimeError, doing: str) -> PeerFailedError:
        """A collective failed (a peer closed its connection, or nobody answered within the timeout): name why."""
        end = time.monotonic() + _PUBLISHED_GRACE_S
        while True:  # a peer that raised publishes before it exits: prefer its own account
            if self._failure is not None:
                return PeerFailedError(self._failure, doing)
            try:
                record = self._read_first()
            except Exception:
                record = None
            if record is not None:
                self._record(record)
                return PeerFailedError(record, doing)
            if time.monotonic() >= end:
                break
            time.sleep(min(0.1, self.interval))
        dead = self._dead_peers()
        detail = f"{type(error).__name__}: {_short(error)}"
        if dead:
            record = FailureRecord(
                dead[0],
                DIED,
                f"the process exited without reporting an error (killed, e.g. kill -9, or crashed); seen by rank "
                f"{self.rank} as {detail}",
                time.time(),
            )
        else:
            record = FailureRecord(
                -1,
                "communication",
                f"{detail} (no rank published a failure and no peer on this host has exited: a peer on another "
                "host died, or nobody answered within fault_tolerance.collective_timeout_s)",
                time.time(),
            )
        self._record(record)
        if dead:
            self._post(record)
        return PeerDiedError(record, doing)

    def _dead_peers(self) -> list[int]:
        """Ranks whose process (on this host) has exited, from the host and pid each left on the board."""
        host = socket.gethostname()
        dead = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                if not self._store.check([f"proc/{rank}"]):
                    continue
                proc = json.loads(self._store.get(f"proc/{rank}"))
            except Exception:
                continue
            if proc.get("host") == host and not _alive(int(proc["pid"])):
                dead.append(rank)
        return dead


def _short(error: BaseException) -> str:
    """gloo's message without its source location and boilerplate: "Connection closed by peer [addr]:port"."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0]


class _Pending:
    """A future-less work handed to the helper thread: its outcome, and the event that says it is known."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.done = False
        self.error: BaseException | None = None


def _wait_in_order(works: queue.SimpleQueue) -> None:
    while True:
        handle, pending = works.get()
        try:
            handle.wait()
        except BaseException as error:  # handed to the waiting thread, which raises it
            pending.error = error
        pending.done = True
        pending.event.set()
        # Drop the work before blocking on the next one: it holds its tensors (a whole reduce-scatter input).
        del handle, pending


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie — killed, not yet reaped by its parent — counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def write_failure_file(record: FailureRecord) -> None:
    """``$SHARDSPEED_FAILURE_DIR/rank<R>.json`` for the launcher (written atomically); nothing if unset."""
    directory = os.environ.get(FAILURE_DIR_ENV)
    if not directory:
        return
    try:
        path = Path(directory) / f"rank{record.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(record.to_json())
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("could not write the failure file in %s: %s", directory, error)


def _remove_own_failure_file(rank: int) -> None:
    directory = os.environ.get(FAILURE_DIR_ENV)
    if directory:
        with contextlib.suppress(OSError):
            (Path(directory) / f"rank{rank}.json").unlink()
