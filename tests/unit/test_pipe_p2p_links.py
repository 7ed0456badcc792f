"""Per-direction communicators for the pipeline's links ([Note: pipeline links], pipe/links.py), with no GPU.

Every schedule runs through the real ``PipeExecutor`` (its grouping of a step's messages into ``send`` /
``exchange``) and the real ``PipeChannel`` (its header/data rounds) over the fake NCCL fabric of
``nccl_fabric.py``: one stream per communicator, a send complete only once its receive is posted. On the default
group alone the interleaved schedules deadlock (a lone send holds back its rank's later receives); with one group per
directed link every schedule finishes, with gradients equal to one process's backward. The group creation is
checked against a fake ``torch.distributed``: every rank creates every link's group in the same order, and only
under NCCL by default."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch
from nccl_fabric import Deadlock, FakeCollectives, run_threads
from test_pipe_executor import DIM, Chunks, Hooks, _loss, _reference_grads

import shardspeed.pipe.links as links_module
from shardspeed.pipe.data import StageData
from shardspeed.pipe.executor import PipeExecutor
from shardspeed.pipe.links import PipeLinks, build_links, directed_links
from shardspeed.pipe.p2p import PipeChannel
from shardspeed.pipe.schedule import build_schedule
from shardspeed.topology import AxisGroup, MeshShape, Topology

CPU = torch.device("cpu")


# --- which links, which groups ---------------------------------------------------------------------------------------
def test_directed_links_follow_the_virtual_stages() -> None:
    assert directed_links(1, 1) == directed_links(1, 3) == []
    assert directed_links(2, 1) == directed_links(2, 2) == [(0, 1), (1, 0)]  # at p = 2 the wrap is the plain link
    chain = [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)]
    assert directed_links(4, 1) == chain
    assert directed_links(4, 2) == sorted([*chain, (3, 0), (0, 3)])  # interleaving wraps p-1 -> 0 and back
    assert directed_links(3, 3) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]


class _FakeDist:
    """``get_backend`` / ``new_group`` per thread: the n-th group a rank creates is ``("g", n, ranks)``, so two
    ranks share a group exactly when they created it at the same point of the same order."""

    def __init__(self, backend: str) -> None:
        self.backend, self.local = backend, threading.local()
        self.created: list[tuple[int, ...]] = []

    def get_backend(self, group: Any = None) -> str:
        return self.backend

    def new_group(self, ranks: list[int]) -> Any:
        counter = self.local.__dict__.setdefault("counter", itertools.count())
        n = next(counter)
        if n >= len(self.created):
            self.created.append(tuple(ranks))
        return ("g", n, tuple(ranks))


def _topology(shape: MeshShape, rank: int) -> Topology:
    solo = {axis: AxisGroup(axis, None, (rank,), 0) for axis in ("pipe", "data", "tensor")}
    return Topology(shape, rank, solo)


def test_build_links_creates_one_group_per_directed_link_only_under_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = MeshShape(pipe=2, data=2, tensor=1)  # ranks: (pipe 0: 0, 1), (pipe 1: 2, 3)
    gloo = _FakeDist("gloo")
    monkeypatch.setattr(links_module, "dist", gloo)
    assert build_links(_topology(shape, 0), 2) is None and gloo.created == []  # gloo: today's default group
    nccl = _FakeDist("nccl")
    monkeypatch.setattr(links_module, "dist", nccl)
    links = build_links(_topology(shape, 0), 2)
    assert links is not None and len(links) == 2
    # every rank creates the group of every (link, data index), links sorted: world-collective, one order
    assert nccl.created == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert links.to(2) == ("g", 0, (0, 2)) and links.from_(2) == ("g", 2, (0, 2))  # two communicators, one pair
    with pytest.raises(ValueError, match=r"rank 0 -> rank 3 is not a link of this pipeline"):
        links.to(3)
    assert build_links(_topology(MeshShape(pipe=1, data=4), 0), 1) is None  # one stage: no links
    assert build_links(_topology(shape, 0), 1, per_direction=False) is None


# --- every schedule over the fake NCCL fabric ------------------------------------------------------------------------
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]
CASES = [(name, v, p, m) for name, v in SCHEDULES for p in (2, 3, 4) for m in (p, 2 * p)]


def _pipeline(
    name: str,
    v: int,
    p: int,
    m: int,
    per_direction: bool,
    monkeypatch: pytest.MonkeyPatch,
    dynamic_shape: bool = False,
) -> tuple[list[Chunks], list, Any]:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, DIM, generator=g), torch.randn(2, DIM, generator=g)) for _ in range(m)]
    modules = [Chunks(p, s, v) for s in range(p)]
    fake = _FakeDist("nccl" if per_direction else "gloo")
    monkeypatch.setattr(links_module, "dist", fake)

    def stage(collectives: FakeCollectives, s: int) -> Any:
        links = build_links(_topology(MeshShape(pipe=p), s), v)
        channel = PipeChannel(collectives, CPU, dynamic_shape=dynamic_shape, links=links)  # type: ignore[arg-type]
        executor = PipeExecutor(
            module=modules[s], channel=channel, pipe_ranks=range(p), stage_id=s, chunks=v, loss_fn=_loss
        )
        data = StageData(iter(batches), reads_inputs=s == 0, reads_labels=s == p - 1, device=CPU)
        hooks = Hooks()
        executor.run(build_schedule(name, m, p, s, v).steps(), data, micro_batches=m, hooks=hooks)
        assert hooks.calls == ["tied", "grads", "step"]
        return channel.stats.messages

    _, fabric = run_threads(p, stage, monkeypatch)
    return modules, batches, fabric


@pytest.mark.parametrize(("name", "v", "p", "m"), CASES)
def test_every_schedule_finishes_with_per_direction_groups(
    name: str, v: int, p: int, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules, batches, fabric = _pipeline(name, v, p, m, True, monkeypatch)
    assert None not in fabric.groups_used  # nothing went over the default group
    assert len(fabric.groups_used) == len(directed_links(p, v))
    expected = _reference_grads(p, v, batches)
    for s, module in enumerate(modules):
        for c, layer in enumerate(module.layers):
            w, b = expected[c * p + s]
            torch.testing.assert_close(layer.weight.grad, w, rtol=0, atol=1e-6)
            torch.testing.assert_close(layer.bias.grad, b, rtol=0, atol=1e-6)


def _deadlocks_on_the_default_group(name: str, p: int, m: int) -> bool:
    """Measured on the fake fabric (no buffering): interleaving's lone sends (an activation sent while the peer
    still waits on its own earlier receive) hold back the sender's next receive, except at p = m = 2, where every
    step pairs its sends with receives."""
    return name == "interleaved" and (p, m) != (2, 2)


@pytest.mark.parametrize(("name", "v", "p", "m"), CASES)
def test_the_default_group_alone_deadlocks_interleaving(
    name: str, v: int, p: int, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control, the old channel's path (gloo's choice: ``build_links`` → None): GPipe and 1F1B finish, the
    interleaved schedules deadlock; so the per-direction groups are what makes them finish under NCCL."""
    if _deadlocks_on_the_default_group(name, p, m):
        with pytest.raises(Deadlock, match=r"rank \d+ waits on a batch of group None"):
            _pipeline(name, v, p, m, False, monkeypatch)
    else:
        _pipeline(name, v, p, m, False, monkeypatch)


def test_dynamic_shapes_negotiate_every_message_over_the_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message carries its header (a header batch, then its data) on its link: interleaving still finishes."""
    modules, batches, fabric = _pipeline("interleaved", 2, 4, 8, True, monkeypatch, dynamic_shape=True)
    assert None not in fabric.groups_used
    expected = _reference_grads(4, 2, batches)
    for s, module in enumerate(modules):
        for c, layer in enumerate(module.layers):
            torch.testing.assert_close(layer.weight.grad, expected[c * 4 + s][0], rtol=0, atol=1e-6)


def test_a_peer_off_the_links_is_refused_before_anything_is_posted(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(collectives: FakeCollectives, rank: int) -> Any:
        channel = PipeChannel(collectives, CPU, links=PipeLinks(rank, {(0, 1): "0->1", (1, 0): "1->0"}))  # type: ignore[arg-type]
        if rank == 0:
            with pytest.raises(ValueError, match=r"rank 0 -> rank 2 is not a link of this pipeline"):
                channel.exchange([((torch.ones(2),), 1, "act"), ((torch.ones(2),), 2, "act")], [])
        return channel.stats.messages

    results, fabric = run_threads(3, body, monkeypatch)
    assert results == [0, 0, 0] and fabric.batches == 0


def _ring(links: bool) -> Any:
    """Interleaving's wrap makes a ring (0 → 1 → 2 → 0 at p = 3). Rank 0 sends to 1 and receives from 2 in one
    exchange, negotiating both streams; rank 1 forwards what it receives to 2, rank 2 to 0. Rank 0's data must leave
    while it waits for rank 2's header: a send that waited on the call's receives would close the ring."""
    ring = {(0, 1): "0->1", (1, 2): "1->2", (2, 0): "2->0"}

    def body(collectives: FakeCollectives, rank: int) -> Any:
        channel = PipeChannel(collectives, CPU, links=PipeLinks(rank, ring) if links else None)  # type: ignore[arg-type]
        if rank == 0:
            (got,) = channel.exchange([((torch.arange(3.0),), 1, "a")], [(2, "c")])
        else:
            (got,) = (channel.recv(rank - 1, "ab"[rank - 1]),)
            channel.send((got[0] * 10,), (rank + 1) % 3, "bc"[rank - 1])
        channel.wait_sends()
        return got[0].tolist()

    return body


def test_sends_never_wait_on_the_calls_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    results, _ = run_threads(3, _ring(links=True), monkeypatch)
    assert results == [[0.0, 100.0, 200.0], [0.0, 1.0, 2.0], [0.0, 10.0, 20.0]]
    with pytest.raises(Deadlock):  # the default group: rank 0's data waits behind its header receive
        run_threads(3, _ring(links=False), monkeypatch)
