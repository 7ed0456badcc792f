"""A fake NCCL point-to-point fabric for ``PipeChannel`` on threads of one process (no GPU).

What it models of NCCL's coalesced point-to-point (``batch_isend_irecv``): every batch is on one communicator (a
``group``; None: the default group) and is one request, complete when all of its messages moved; a rank's batches
on one communicator run strictly in the order posted (one stream per communicator); a message moves only when its
send and its receive are both in the batches at the head of their ranks' streams of that communicator (no
buffering: NCCL's behaviour for messages larger than it buffers). gloo is more forgiving: a request there completes
on its own.

A deadlock is detected, not timed out: when every live thread waits on a batch that cannot complete (progress is
made eagerly on every post, under the fabric's lock), each waiter raises ``Deadlock`` naming what every rank waits
for; a timeout remains as the last resort.
"""

from __future__ import annotations

import threading
import types
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import pytest

import shardspeed.pipe.p2p as p2p_module


class Deadlock(RuntimeError):
    pass


class _Batch:
    def __init__(self, ops: int, fabric: Fabric, rank: int, group: Any) -> None:
        self.left, self.fabric, self.rank, self.group = ops, fabric, rank, group

    def wait(self) -> None:
        self.fabric.wait(self)

    def done(self) -> bool:
        return self.left == 0


class Fabric:
    def __init__(self, world: int, timeout_s: float = 20.0) -> None:
        self.world, self.timeout_s = world, timeout_s
        self.cv = threading.Condition()
        # (src, dst, group) → (pending sends, pending receives), each entry (tensor, batch)
        self.links: dict[tuple[int, int, Any], tuple[deque, deque]] = defaultdict(lambda: (deque(), deque()))
        self.streams: dict[tuple[int, Any], deque[_Batch]] = defaultdict(deque)  # (rank, group) → batches
        self.alive = world
        self.waiting: dict[int, _Batch] = {}  # rank → the batch it waits for
        self.error: str | None = None
        self.deadlock: str | None = None
        self.batches = 0
        self.groups_used: set[Any] = set()

    def post(self, rank: int, sends: list, recvs: list, group: Any) -> _Batch:
        with self.cv:
            batch = _Batch(len(sends) + len(recvs), self, rank, group)
            self.batches += 1
            self.groups_used.add(group)
            self.streams[(rank, group)].append(batch)
            for tensor, peer, *_ in sends:
                self.links[(rank, peer, group)][0].append((tensor, batch))
            for tensor, peer, *_ in recvs:
                self.links[(peer, rank, group)][1].append((tensor, batch))
            self._progress()
            return batch

    def _head(self, batch: _Batch) -> bool:
        stream = self.streams[(batch.rank, batch.group)]
        return bool(stream) and stream[0] is batch

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for (src, dst, _), (sends, recvs) in self.links.items():
                if sends and recvs and self._head(sends[0][1]) and self._head(recvs[0][1]):
                    (out, sb), (into, rb) = sends.popleft(), recvs.popleft()
                    if out.dtype != into.dtype or out.numel() != into.numel():
                        self.error = (
                            f"link {src}->{dst}: sent {out.dtype}[{out.numel()}] into {into.dtype}[{into.numel()}]"
                        )
                    else:
                        into.copy_(out.reshape(into.shape))
                    sb.left -= 1
                    rb.left -= 1
                    moved = True
            for stream in self.streams.values():
                while stream and stream[0].left == 0:
                    stream.popleft()
                    moved = True
        self.cv.notify_all()

    def _check_stuck(self) -> None:
        """Under the lock: every live thread waits and nothing can move any more."""
        stuck = self.waiting and len(self.waiting) == self.alive and all(b.left for b in self.waiting.values())
        if self.deadlock is None and stuck:
            what = "; ".join(
                f"rank {r} waits on a batch of group {b.group!r} ({b.left} message(s) left)"
                for r, b in sorted(self.waiting.items())
            )
            self.deadlock = f"deadlock: {what}"
            self.cv.notify_all()

    def wait(self, batch: _Batch) -> None:
        with self.cv:
            rank = threading.current_thread().name
            key = int(rank.removeprefix("rank")) if rank.startswith("rank") else -1
            self.waiting[key] = batch
            try:
                self._check_stuck()
                ok = self.cv.wait_for(
                    lambda: batch.left == 0 or self.error is not None or self.deadlock is not None, self.timeout_s
                )
            finally:
                del self.waiting[key]
            if self.error is not None:
                raise RuntimeError(self.error)
            if batch.left == 0:
                return
            if self.deadlock is not None:
                raise Deadlock(self.deadlock)
            if not ok:
                raise TimeoutError("deadlock: a batch never completed (timeout)")

    def leave(self) -> None:
        with self.cv:
            self.alive -= 1
            self._check_stuck()


class FakeCollectives:
    """``Collectives.p2p`` over the fabric: one coalesced request per batch, as NCCL's; one group per batch, as
    ``batch_isend_irecv`` requires."""

    def __init__(self, fabric: Fabric, rank: int) -> None:
        self.fabric, self.rank = fabric, rank

    def p2p(self, sends: list, recvs: list, *, tag: str = "", group: Any = None) -> Any:
        batch = self.fabric.post(self.rank, list(sends), list(recvs), group)
        return types.SimpleNamespace(sends=batch, recvs=batch, wait=batch.wait)


def run_threads(
    world: int,
    body: Callable[[FakeCollectives, int], Any],
    monkeypatch: pytest.MonkeyPatch,
    timeout_s: float = 20.0,
) -> tuple[list[Any], Fabric]:
    """``body(collectives, rank)`` on one thread per rank (named ``rank{r}``); results by rank, an exception
    re-raised (a ``Deadlock`` first: the other ranks' errors are its consequences)."""
    fabric = Fabric(world, timeout_s)
    local = threading.local()
    fake_dist = types.SimpleNamespace(get_rank=lambda: local.rank, get_world_size=lambda: world)
    monkeypatch.setattr(p2p_module, "dist", fake_dist)
    results: list[Any] = [None] * world

    def thread(rank: int) -> None:
        local.rank = rank
        try:
            results[rank] = body(FakeCollectives(fabric, rank), rank)
        except BaseException as exc:
            results[rank] = exc
        finally:
            fabric.leave()

    threads = [threading.Thread(target=thread, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout_s)
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in sorted(errors, key=lambda e: not isinstance(e, Deadlock)):
        raise error
    return results, fabric
