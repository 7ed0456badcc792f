"""The pipeline channel (pipe/p2p.py) over ``Collectives.p2p`` on gloo: tuples of mixed tensors, shapes negotiated
once per stream (headers counted in the comms log), dynamic shapes, reset, the shape-change error, partitioned
sends over a tensor axis (world 4: pipe 2 × tensor 2), a peer's failure interrupting a blocked receive, and the
interleaved executor over one process group per directed link (pipe/links.py, forced on gloo)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from shardspeed.comm.collectives import Collectives
from shardspeed.comm.log import CommsLog
from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.faults.errors import PeerFailedError
from shardspeed.faults.process import failure_board
from shardspeed.pipe.data import StageData
from shardspeed.pipe.executor import PipeExecutor
from shardspeed.pipe.links import build_links
from shardspeed.pipe.p2p import PipeChannel
from shardspeed.pipe.schedule import build_schedule
from shardspeed.topology import MeshShape, Topology

CPU = torch.device("cpu")


def _channel(board: bool = False, **kwargs: Any) -> tuple[PipeChannel, CommsLog]:
    log = CommsLog(enabled=True)
    waits = failure_board(FaultToleranceConfig(watch_interval_s=0.1)) if board else None
    return PipeChannel(Collectives(log, waits), CPU, **kwargs), log


def _message(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return (
        torch.randn(2, 3, generator=g).requires_grad_(),  # an activation
        torch.randint(0, 2, (2, 3), generator=g),  # an int64 mask
        torch.rand(4, generator=g) > 0.5,  # bool
        torch.tensor(float(step)),  # 0-d, no grad
        torch.randn(3, generator=g).to(torch.bfloat16),  # another dtype, no grad
        torch.empty(0, 2),  # nothing to send
    )


def _counts(log: CommsLog) -> dict[str, tuple[int, int]]:
    return {key: (t.count, t.bytes) for key, t in log.totals.items()}


def _send_recv_mixed(rank: int, world: int) -> Any:
    channel, log = _channel()
    if rank == 0:
        for step in range(3):
            channel.send(_message(step), 1, "act")
        channel.wait_sends()
        assert log.algorithmic_elements() == 3 * (6 + 6 + 4 + 1 + 3) + 64  # a message counts where it is sent
        return _counts(log), channel.stats.messages
    got = [channel.recv(0, "act") for _ in range(3)]
    assert log.algorithmic_elements() == 0
    return _counts(log), [[(t.dtype, tuple(t.shape), t.requires_grad, t.detach().tolist()) for t in m] for m in got]


def test_tuple_of_mixed_tensors_negotiated_once(dist_run) -> None:
    (sent, messages), (received, got) = dist_run(_send_recv_mixed, 2)
    for step, message in enumerate(got):
        expected = _message(step)
        assert [(dt, shape) for dt, shape, _, _ in message] == [(t.dtype, tuple(t.shape)) for t in expected]
        assert [rg for _, _, rg, _ in message] == [True, False, False, False, False, False]
        assert [v for _, _, _, v in message] == [t.detach().tolist() for t in expected]
    # One header per stream (64 int64 = 512 bytes), then data only: five wire tensors per message (the empty one
    # is not sent); bytes as sent, on both sides.
    data_bytes = 3 * (6 * 4 + 6 * 8 + 4 * 1 + 4 + 3 * 2)
    assert sent == {"send:pipe.act.meta": (1, 512), "send:pipe.act": (15, data_bytes)}
    assert received == {"recv:pipe.act.meta": (1, 512), "recv:pipe.act": (15, data_bytes)}
    assert messages == 3


def _exchange_both_ways(rank: int, world: int, board: bool) -> Any:
    """Each rank sends to the other and receives from it in one call, two streams on the same link (as under
    interleaving), negotiating in the first call: the framing must survive rounds. With a failure board every wait
    goes through it (gloo's p2p requests have no future: the board's helper thread waits them)."""
    channel, log = _channel(board)
    peer = 1 - rank
    out = []
    for step in range(3):
        act = torch.full((2, 1), float(rank * 10 + step))
        grad = torch.arange(3, dtype=torch.float64) + rank
        sends = [((act,), peer, "act"), ((grad, torch.ones(2, dtype=torch.int32)), peer, "grad")]
        got = channel.exchange(sends, [(peer, "act"), (peer, "grad")]) if step < 2 else None
        if got is None:  # a send() then a recv() against the peer's exchange-shaped traffic
            channel.send(*sends[0])
            channel.send(*sends[1])
            got = [channel.recv(peer, "act"), channel.recv(peer, "grad")]
        out.append([[t.tolist() for t in m] for m in got])
    channel.wait_sends()
    return out, _counts(log)


@pytest.mark.parametrize("board", [False, True], ids=["plain", "failure-board"])
def test_exchange_negotiates_two_streams_on_one_link(dist_run, board: bool) -> None:
    results = dist_run(_exchange_both_ways, 2, board)
    for rank, (out, counts) in enumerate(results):
        peer = 1 - rank
        for step in range(3):
            assert out[step] == [[[[float(peer * 10 + step)]] * 2], [[peer + 0.0, peer + 1.0, peer + 2.0], [1, 1]]]
        assert counts["send:pipe.act.meta"][0] == counts["send:pipe.grad.meta"][0] == 1
        assert counts["recv:pipe.act.meta"][0] == counts["recv:pipe.grad.meta"][0] == 1


def _chain(rank: int, world: int) -> Any:
    """A 4-stage chain in 1F1B's steady state: every stage at once sends its activation forward and a gradient
    backward and receives both, in one exchange (the middle stages talk to two peers; the first call negotiates)."""
    channel, _ = _channel()
    prev, nxt = rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None
    seen = []
    for step in range(3):
        act = (torch.full((2, 3), 100.0 * rank + step).requires_grad_(), torch.full((2,), rank, dtype=torch.int64))
        grad = (torch.full((2, 3), -100.0 * rank - step),)
        sends = ([(act, nxt, "act")] if nxt is not None else []) + ([(grad, prev, "grad")] if prev is not None else [])
        recvs = ([(prev, "act")] if prev is not None else []) + ([(nxt, "grad")] if nxt is not None else [])
        got = channel.exchange(sends, recvs)
        seen.append([[float(t.flatten()[0]) for t in message] for message in got])
    channel.wait_sends()
    return seen


def test_exchange_along_a_four_stage_chain(dist_run) -> None:
    results = dist_run(_chain, 4)
    for rank, seen in enumerate(results):
        for step, got in enumerate(seen):
            expected = ([[100.0 * (rank - 1) + step, rank - 1]] if rank > 0 else []) + (
                [[-100.0 * (rank + 1) - step]] if rank < 3 else []
            )
            assert got == expected


def _dynamic(rank: int, world: int) -> Any:
    channel, log = _channel(dynamic_shape=True)
    if rank == 0:
        for n in (1, 4, 2):
            channel.send((torch.arange(n * 2.0).view(n, 2), torch.ones(n, dtype=torch.bool)), 1, "act")
        channel.wait_sends()
        return _counts(log)["send:pipe.act.meta"]
    return [[t.tolist() for t in channel.recv(0, "act")] for _ in range(3)]


def test_dynamic_shapes_send_a_header_every_message(dist_run) -> None:
    headers, got = dist_run(_dynamic, 2)
    assert headers == (3, 3 * 512)
    for n, (values, mask) in zip((1, 4, 2), got, strict=True):
        assert values == torch.arange(n * 2.0).view(n, 2).tolist()
        assert mask == [True] * n


def _shape_change(rank: int, world: int) -> Any:
    channel, log = _channel()
    if rank == 0:
        try:  # refused as a whole: the first message's negotiation is not recorded either
            channel.exchange([((torch.zeros(2, 8),), 1, "act"), ((torch.zeros(1), None), 1, "act")], [])
        except TypeError as exc:
            refused = str(exc)
        assert "element 1 of the tuple is NoneType" in refused
        channel.send((torch.zeros(2, 8),), 1, "act")  # so this one still carries the header
        try:
            channel.send((torch.zeros(4, 8),), 1, "act")
            error = "no error"
        except ValueError as exc:
            error = str(exc)
        channel.reset_shapes()
        channel.send((torch.ones(4, 8),), 1, "act")
        channel.wait_sends()
        try:
            channel.send((torch.ones(1),), 0, "act")
        except ValueError as exc:
            error += f" | {exc}"
        return error, _counts(log)["send:pipe.act.meta"][0]
    first = channel.recv(0, "act")[0]
    channel.reset_shapes()
    second = channel.recv(0, "act")[0]
    return tuple(first.shape), tuple(second.shape), second.sum().item()


def test_shape_change_is_an_error_and_reset_renegotiates(dist_run) -> None:
    (error, headers), received = dist_run(_shape_change, 2)
    assert "PipeChannel.send to rank 1 on stream 'act': tensor 0 is now float32[4, 8]" in error
    assert "negotiated float32[2, 8]" in error
    assert "dynamic_shape=True" in error and "reset_activation_shape()" in error
    assert "peer 0 is not another rank of this world of 2" in error
    assert headers == 2
    assert received == ((2, 8), (4, 8), 32.0)


def _partitioned(rank: int, world: int, partitioned: bool) -> Any:
    topology = Topology.build(MeshShape(pipe=2, tensor=2))
    log = CommsLog(enabled=True)
    channel = PipeChannel(Collectives(log), CPU, partition=topology.tensor if partitioned else None)
    stage, tensor_rank = topology.pipe.rank, topology.tensor.rank
    # Every tensor rank of stage 0 holds the same activation (as between pipeline stages).
    g = torch.Generator().manual_seed(7)
    message = (
        torch.randn(3, 5, generator=g).requires_grad_(),  # 15 floats: padded to 16, 8 per tensor rank
        torch.arange(6).view(2, 3),  # an int mask: whole
        torch.tensor([2.5]),  # fewer elements than tensor ranks: whole
    )
    if stage == 0:
        channel.send(message, topology.layout[2 + tensor_rank], "act")  # the same tensor rank on stage 1
        channel.wait_sends()
        return _counts(log)
    got = channel.recv(topology.layout[tensor_rank], "act")
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got, message, strict=True))
    assert [t.requires_grad for t in got] == [True, False, False]
    return _counts(log)


def test_partitioned_send_equals_whole_with_a_tensor_axis(dist_run) -> None:
    whole = dist_run(_partitioned, 4, False)
    split = dist_run(_partitioned, 4, True)
    assert whole[0]["send:pipe.act"] == (3, 15 * 4 + 6 * 8 + 4)
    # p2p carries 1/T of the float tensor (8 of 16 padded elements); the receivers all-gather the rest.
    for rank in (0, 1):
        assert split[rank]["send:pipe.act"] == (3, 8 * 4 + 6 * 8 + 4)
        assert "all_gather:pipe.act.gather" not in split[rank]
    for rank in (2, 3):
        assert split[rank]["recv:pipe.act"] == (3, 8 * 4 + 6 * 8 + 4)
        assert split[rank]["all_gather:pipe.act.gather"] == (1, 16 * 4)


def _peer_fails(rank: int, world: int) -> Any:
    board = failure_board(FaultToleranceConfig(watch_interval_s=0.1))
    channel = PipeChannel(Collectives(CommsLog(), board), CPU)
    if rank == 1:  # fails before sending: what the engine's guard does with an exception in the stage's forward
        board.publish("forward", RuntimeError("bad batch on stage 1"))
        return None
    start = time.monotonic()
    try:
        channel.recv(1, "grad")
    except PeerFailedError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


def test_peer_failure_interrupts_a_blocked_recv(dist_run) -> None:
    (message, waited), _ = dist_run(_peer_fails, 2, deadline_s=30.0)
    assert "rank 1" in message and "bad batch on stage 1" in message
    assert "p2p 'pipe'" in message and "receives from ranks [1]" in message
    assert waited < 10.0


# --- per-direction links ([Note: pipeline links]) over real process groups ------------------------------------------
class _Chunks(torch.nn.Module):
    """Stage ``s``'s chunks of a chain of seeded linear layers: chunk ``c`` is virtual stage ``c·p + s``."""

    def __init__(self, stages: int, stage: int, chunks: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_linear(c * stages + stage) for c in range(chunks))

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        return torch.tanh(self.layers[chunk](x))


def _linear(virtual: int) -> torch.nn.Linear:
    torch.manual_seed(100 + virtual)
    return torch.nn.Linear(3, 3)


def _mse(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((out - labels) ** 2).mean()


def _batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)) for _ in range(m)]


class _Hooks:
    def backward(self, run: Any, final: bool, last_of_micro_batch: bool = True) -> None:
        run()

    def reduce_tied_grads(self) -> None: ...

    def reduce_grads(self) -> None: ...

    def optimizer_step(self, losses: Any) -> None: ...


def _interleaved_over_links(rank: int, world: int, chunks: int, m: int) -> Any:
    """The real executor, interleaved, over one gloo group per directed link (forced: gloo's default is none)."""
    topology = Topology.build(MeshShape(pipe=world))
    assert build_links(topology, chunks) is None  # gloo: the default group serves
    links = build_links(topology, chunks, per_direction=True)
    assert links is not None
    channel, _ = _channel(links=links)
    module = _Chunks(world, rank, chunks)
    executor = PipeExecutor(
        module=module, channel=channel, pipe_ranks=topology.pipe.ranks, stage_id=rank, chunks=chunks, loss_fn=_mse
    )
    data = StageData(
        iter(_batches(m)),
        reads_inputs=rank == 0,
        reads_labels=rank == world - 1,
        device=CPU,
    )
    schedule = build_schedule("interleaved", m, world, rank, chunks)
    executor.run(schedule.steps(), data, micro_batches=m, hooks=_Hooks())
    grads = {c * world + rank: (layer.weight.grad, layer.bias.grad) for c, layer in enumerate(module.layers)}
    return grads, len(links), channel.stats.messages


def test_interleaved_executor_over_per_direction_groups(dist_run) -> None:
    world, chunks, m = 4, 2, 8
    results = dist_run(_interleaved_over_links, world, chunks, m)
    layers = [_linear(k) for k in range(world * chunks)]
    for x, y in _batches(m):
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        (_mse(h, y) / m).backward()
    for rank, (grads, links, messages) in enumerate(results):
        assert links == 4  # to and from each neighbour; stages 0 and 3 are neighbours through the wrap
        # every virtual stage but the first receives m activations, every one but the last m gradients
        assert messages == 2 * m * (2 * chunks - (rank == 0) - (rank == world - 1))
        for k, (w, b) in grads.items():
            torch.testing.assert_close(w, layers[k].weight.grad, rtol=0, atol=1e-6)
            torch.testing.assert_close(b, layers[k].bias.grad, rtol=0, atol=1e-6)
