"""The pending-communication handles ``Collectives`` returns: ``Work`` (one torch request, or a finished no-op),
``P2PWork`` (a point-to-point batch), ``CompositeWork`` (one logical collective carried by several requests: [Note:
collective algorithms] in comm/algorithms.py). Every wait goes through the failure board when there is one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardspeed.comm.blocked import BlockedTime, timed_wait
from shardspeed.comm.composite import Launched
from shardspeed.comm.simulated_link import Hold
from shardspeed.faults.board import FailureBoard


class Work:
    """A pending collective (or an already-finished no-op). ``wait()`` is idempotent; with a failure board it
    raises ``PeerFailedError`` instead of waiting for a peer that failed."""

    def __init__(
        self,
        handle: dist.Work | None,
        board: FailureBoard | None = None,
        doing: Callable[[], str] = str,
        *,
        blocked: BlockedTime | None = None,
        key: str = "",
        on_complete: Callable[[], None] | None = None,
        hold: Hold | None = None,
    ) -> None:
        self._handle = handle
        self._board = board
        self._doing = doing
        self._blocked, self._key = blocked, key  # [Note: exposed communication] in comm/blocked.py
        self._on_complete = on_complete  # the comms log's latency timer ([Note: comms-log latency] in comm/log.py)
        self._hold = hold  # a simulated link's deadline ([Note: simulated link] in comm/simulated_link.py)

    def _wait_hold(self) -> None:
        """Block until the simulated link's deadline, as blocked communication time."""
        if self._hold is not None:
            hold, self._hold = self._hold, None
            timed_wait(self._blocked, self._key, hold.wait)

    def _completed(self) -> None:
        """The call was seen complete: tell the comms log, once."""
        if self._on_complete is not None:
            on_complete, self._on_complete = self._on_complete, None
            on_complete()

    def wait(self) -> None:
        if self._handle is not None:
            handle, board = self._handle, self._board
            if board is None:
                timed_wait(self._blocked, self._key, handle.wait)
            else:
                timed_wait(self._blocked, self._key, lambda: board.wait(handle, self._doing))
            self._handle = None
        self._wait_hold()
        self._completed()

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (the collective has finished, and a simulated link's deadline
        has passed)."""
        if (self._handle is None or self._handle.is_completed()) and (self._hold is None or self._hold.passed()):
            self._hold = None
            self._completed()
            return True
        return False


class P2PWork(Work):
    """The requests of one ``Collectives.p2p`` batch. ``wait()`` waits all of them; ``sends`` / ``recvs`` are
    Works over one side only (under NCCL the batch is one coalesced request: both sides wait it)."""

    def __init__(
        self,
        handles: list[dist.Work],
        is_send: list[bool],
        board: FailureBoard | None,
        doing: Callable[[], str],
        keep: Sequence[torch.Tensor] = (),
        blocked: BlockedTime | None = None,
        tag: str = "",
        timers: Sequence[Callable[[], None] | None] = (),
    ) -> None:
        super().__init__(None, board, doing)
        self._keep = list(keep)  # the batch's tensors, alive until this Work is dropped (gloo reads them async)
        sends, recvs = (blocked, f"send:{tag}" if tag else "send"), (blocked, f"recv:{tag}" if tag else "recv")
        timers = list(timers) or [None] * len(is_send)  # per message: the comms log's latency timers
        if len(handles) == len(is_send):  # gloo: one request per message
            mine = list(zip(handles, is_send, timers, strict=True))
            self.sends = _Works([h for h, s, _ in mine if s], board, doing, *sends, [t for _, s, t in mine if s])
            self.recvs = _Works(
                [h for h, s, _ in mine if not s], board, doing, *recvs, [t for _, s, t in mine if not s]
            )
        else:  # NCCL: one request for the whole batch, which completes every message
            every = [t for t in timers if t is not None]

            def all_done() -> None:
                for timer in every:
                    timer()

            self.sends = self.recvs = _Works(
                handles, board, doing, blocked, f"p2p:{tag}" if tag else "p2p", [*[None] * (len(handles) - 1), all_done]
            )

    def wait(self) -> None:
        self.recvs.wait()
        self.sends.wait()

    def done(self) -> bool:
        return self.recvs.done() and self.sends.done()


class _Works(Work):
    """Several requests waited in order, each through the failure board when there is one."""

    def __init__(
        self,
        handles: list[dist.Work],
        board: FailureBoard | None,
        doing: Callable[[], str],
        blocked: BlockedTime | None = None,
        key: str = "",
        timers: Sequence[Callable[[], None] | None] = (),
    ) -> None:
        super().__init__(None, board, doing)
        timers = list(timers) if len(timers) == len(handles) else [None] * len(handles)
        self._works = [
            Work(h, board, doing, blocked=blocked, key=key, on_complete=t) for h, t in zip(handles, timers, strict=True)
        ]

    def wait(self) -> None:
        while self._works:
            self._works[0].wait()
            self._works.pop(0)

    def done(self) -> bool:
        return all(w.done() for w in self._works)


class CompositeWork(Work):
    """One logical collective carried by several handles plus a completion action ([Note: collective
    algorithms] in comm/algorithms.py). ``wait()`` waits each handle in launch order — through the failure board
    when there is one, so a peer's failure mid-way is ``PeerFailedError`` — then runs the action once; the wait is
    recorded once under the logical op's key. Idempotent: a second ``wait()`` does nothing."""

    def __init__(
        self,
        launched: Launched,
        board: FailureBoard | None,
        doing: Callable[[], str],
        *,
        blocked: BlockedTime | None,
        key: str,
        on_complete: Callable[[], None] | None = None,
        hold: Hold | None = None,
    ) -> None:
        super().__init__(None, board, doing, blocked=blocked, key=key, on_complete=on_complete, hold=hold)
        self._handles = list(launched.handles)
        self._finish = launched.finish
        self._keep = launched.keep  # inputs and outputs alive until the handles are waited (gloo reads them async)

    def wait(self) -> None:
        if self._handles:
            timed_wait(self._blocked, self._key, self._wait_handles)
        self._wait_hold()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        self._completed()
        self._keep = ()

    def _wait_handles(self) -> None:
        while self._handles:
            handle = self._handles[0]
            if self._board is None:
                handle.wait()
            else:
                self._board.wait(handle, self._doing)
            self._handles.pop(0)

    def done(self) -> bool:
        """Whether the logical op is complete: every handle has finished *and* the completion action ran (the copy
        into the output of an all-reduce-then-slice). Once the handles have finished the action runs here, so a
        caller that polls ``done()`` never sees True before the output holds the result."""
        if not all(h.is_completed() for h in self._handles) or not (self._hold is None or self._hold.passed()):
            return False
        self.wait()  # returns at once (every handle finished): runs the action, once
        return True
