"""The RNG tracker and model-parallel seeding, against generators seeded by hand."""

from __future__ import annotations

import pytest
import torch

from shardspeed.checkpointing import CheckpointingContext, RNGStatesTracker
from shardspeed.checkpointing.rng import MODEL_PARALLEL_RNG, RngSnapshot
from shardspeed.topology import AxisGroup

CPU = torch.device("cpu")


def draws(seed: int, n: int = 5) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_fork_runs_on_the_named_stream_and_leaves_the_default_stream_alone() -> None:
    tracker = RNGStatesTracker(CPU)
    torch.manual_seed(1)
    tracker.add("a", 99)
    with tracker.fork("a"):
        first = torch.rand(5)
    outside = torch.rand(5)
    with tracker.fork("a"):
        second = torch.rand(5)
    both = draws(99, 10)
    assert torch.equal(first, both[:5]) and torch.equal(second, both[5:])  # the named stream continues
    assert torch.equal(outside, draws(1))  # add() and fork() did not move the default stream


def test_states_round_trip_and_are_copies() -> None:
    tracker = RNGStatesTracker(CPU)
    tracker.add(MODEL_PARALLEL_RNG, 5)
    saved = tracker.get_states()
    with tracker.fork():
        a = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork():
        b = torch.rand(3)
    assert torch.equal(a, b)


def test_tracker_errors_name_the_problem() -> None:
    tracker = RNGStatesTracker(CPU)
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="a state named 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="no state named 'nope'; known states: 'a'"), tracker.fork("nope"):
        pass
    tracker.reset()
    tracker.add("a", 1)  # reset forgets names and seeds


@pytest.mark.parametrize("tensor_rank", [0, 1, 3])
def test_model_parallel_seed_offsets_the_tensor_rank(tensor_rank: int) -> None:
    axis = AxisGroup("tensor", None, tuple(range(4)), tensor_rank)
    ctx = CheckpointingContext(tensor_axis=axis, tracker=RNGStatesTracker(CPU))
    ctx.model_parallel_manual_seed(100)
    assert torch.equal(torch.rand(5), draws(100))  # default stream: the seed itself, same on every rank
    with ctx.tracker.fork():
        assert torch.equal(torch.rand(5), draws(100 + 2718 + tensor_rank))
    with pytest.raises(ValueError, match=r"model_parallel_manual_seed\(seed=-1\)"):
        ctx.model_parallel_manual_seed(-1)


def test_snapshot_replays_and_then_restores_every_stream() -> None:
    tracker = RNGStatesTracker(CPU)
    tracker.add(MODEL_PARALLEL_RNG, 3)
    torch.manual_seed(8)
    snapshot = RngSnapshot.capture(tracker)
    with tracker.fork():
        forked = torch.rand(2)
    plain = torch.rand(2)
    with snapshot.restored():
        with tracker.fork():
            assert torch.equal(torch.rand(2), forked)
        assert torch.equal(torch.rand(2), plain)
    with tracker.fork():
        after_fork = torch.rand(2)
    after = torch.rand(2)
    assert torch.equal(after, draws(8, 4)[2:])  # the default stream continues as if nothing was replayed
    assert torch.equal(after_fork, draws(3, 4)[2:])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tracker_and_checkpointed_cuda_dropout() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    ctx = CheckpointingContext()
    assert ctx.tracker.device == device
    ctx.model_parallel_manual_seed(4)
    linear = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(16, 8, device=device, requires_grad=True)

    def region(h: torch.Tensor) -> torch.Tensor:
        with ctx.tracker.fork():
            h = torch.nn.functional.dropout(linear(h), 0.5, training=True)
        return torch.nn.functional.dropout(h, 0.5, training=True)

    results = []
    for checkpointed in (False, True):
        torch.cuda.manual_seed(6)
        ctx.model_parallel_manual_seed(4)
        linear.zero_grad(set_to_none=True)
        x.grad = None
        out = ctx.checkpoint(region, x) if checkpointed else region(x)
        out.sum().backward()
        results.append((out.detach(), linear.weight.grad.clone(), x.grad.clone(), torch.rand(3, device=device)))
    for plain, ckpt in zip(*results):
        assert torch.equal(plain, ckpt)
