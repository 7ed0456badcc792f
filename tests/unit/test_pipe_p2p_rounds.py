"""The pipeline channel's rounds under NCCL's stricter semantics, with no GPU: two or more ``PipeChannel`` on
threads of one process over a fake fabric that behaves like NCCL's coalesced point-to-point ([Note: pipeline
channel]; ``nccl_fabric.py``): a rank's batches run strictly in the order posted (one stream; here everything is on
the default group), a message moves only when both its send and its receive are in the batches at the head of their
ranks' queues, and a batch is one request, complete when all of its messages moved. gloo (the dist tests) is more
forgiving: a request there completes on its own. The per-direction links: ``test_pipe_p2p_links.py``.

What this shows: while negotiating, ``exchange`` never puts data in the batch carrying the header the receiver must
read first, so stages that exchange with each other at once, negotiating new streams (or every message under
``dynamic_shape``), finish; and the fake is strict enough to see the deadlock of two stages that each ``send`` and
then ``recv`` separately (what the executor avoids by posting a step's messages with one ``exchange``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from nccl_fabric import Deadlock, FakeCollectives, run_threads

from shardspeed.pipe.p2p import PipeChannel


def _run(
    world: int,
    body: Callable[[PipeChannel, int], Any],
    monkeypatch: pytest.MonkeyPatch,
    timeout_s: float = 5.0,
    **kwargs: Any,
) -> list:
    """``body(channel, rank)`` on one thread per rank over the default group; results by rank."""

    def thread(collectives: FakeCollectives, rank: int) -> Any:
        return body(PipeChannel(collectives, torch.device("cpu"), **kwargs), rank)  # type: ignore[arg-type]

    return run_threads(world, thread, monkeypatch, timeout_s)[0]


def _exchange_steps(channel: PipeChannel, rank: int, steps: int = 3) -> list:
    """Every rank exchanges with both neighbours in a chain at once: activations forward, gradients back, two
    tensors per activation (a float and an int mask), shapes growing per step (used with dynamic_shape)."""
    world = channel._world
    prev, nxt = rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None
    seen = []
    for step in range(steps):
        width = 2 + (step if channel.dynamic_shape else 0)
        act = (torch.full((width, 3), 10.0 * rank + step), torch.full((width,), rank, dtype=torch.int64))
        grad = (torch.full((width, 3), -10.0 * rank - step),)
        sends = ([(act, nxt, "act")] if nxt is not None else []) + ([(grad, prev, "grad")] if prev is not None else [])
        recvs = ([(prev, "act")] if prev is not None else []) + ([(nxt, "grad")] if nxt is not None else [])
        got = channel.exchange(sends, recvs)
        seen.append([(tuple(m[0].shape), float(m[0].flatten()[0])) for m in got])
    channel.wait_sends()
    return seen


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dynamic_shape", [False, True], ids=["negotiate-once", "dynamic"])
def test_negotiating_exchanges_finish_under_coalesced_in_order_batches(
    world: int, dynamic_shape: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _run(world, _exchange_steps, monkeypatch, dynamic_shape=dynamic_shape)
    for rank, seen in enumerate(results):
        for step, got in enumerate(seen):
            width = 2 + (step if dynamic_shape else 0)
            expected = ([((width, 3), 10.0 * (rank - 1) + step)] if rank > 0 else []) + (
                [((width, 3), -10.0 * (rank + 1) - step)] if rank < world - 1 else []
            )
            assert got == expected


def _two_streams_one_link(channel: PipeChannel, rank: int) -> list:
    """Interleaving's case: two streams on one link in one exchange, each negotiating, in both directions."""
    peer = 1 - rank
    out = []
    for step in range(2):
        sends = [((torch.full((3,), rank + step),), peer, "act"), ((torch.arange(4) + rank,), peer, "grad")]
        got = channel.exchange(sends, [(peer, "act"), (peer, "grad")])
        out.append([m[0].tolist() for m in got])
    return out


def test_two_negotiating_streams_on_one_link(monkeypatch: pytest.MonkeyPatch) -> None:
    results = _run(2, _two_streams_one_link, monkeypatch)
    for rank, out in enumerate(results):
        peer = 1 - rank
        assert out == [[[float(peer + step)] * 3, [peer + i for i in range(4)]] for step in range(2)]


def _send_then_recv(channel: PipeChannel, rank: int) -> None:
    channel.send((torch.ones(4),), 1 - rank, "x")
    channel.recv(1 - rank, "x")


def test_the_fabric_sees_separately_posted_sends_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: both stages ``send`` then ``recv`` — under in-order coalesced batches each receive waits behind
    its own send, which waits for the peer's receive (with NCCL, for messages it does not buffer)."""
    with pytest.raises(Deadlock, match="deadlock"):
        _run(2, _send_then_recv, monkeypatch)
