"""The model-parallel RNG stream without a process group: re-seeding when the tensor rank becomes known, the
tracker states in a checkpoint's RNG record (and records from before they were there), and the dropout regions."""

from __future__ import annotations

import logging

import pytest
import torch

from shardspeed import checkpointing
from shardspeed.checkpoint.rng import capture_rng, restore_rng
from shardspeed.checkpointing import CheckpointingContext, RNGStatesTracker
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.random import TensorParallelDropout, model_parallel_seed, model_rng_trackers
from shardspeed.tensor_parallel.sequence import SequenceParallelDropout
from shardspeed.topology import AxisGroup

CPU = torch.device("cpu")


def _axis(rank: int, size: int = 2) -> AxisGroup:
    return AxisGroup("tensor", None, tuple(range(size)), rank)


def _draw(tracker: RNGStatesTracker) -> torch.Tensor:
    with tracker.fork():
        return torch.rand(8)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _no_default_context():
    checkpointing.set_default_context(None)
    yield
    checkpointing.set_default_context(None)


def test_seeding_before_the_tensor_axis_is_known_is_redone_for_the_tensor_rank() -> None:
    context = CheckpointingContext(tracker=RNGStatesTracker(CPU), tensor_axis=_axis(0, 1), configured=False)
    context.model_parallel_manual_seed(5)  # as tensor rank 0 of a one-rank axis
    context.use_tensor_axis(_axis(1))  # the engine's topology: this is tensor rank 1
    assert torch.equal(_draw(context.tracker), torch.rand(8, generator=_gen(5 + 2718 + 1)))
    drawn_on = _draw(context.tracker)
    context.use_tensor_axis(_axis(1))  # the same rank again (a second initialize): the stream is not rewound
    assert not torch.equal(_draw(context.tracker), drawn_on)
    assert context.tracker.model_parallel_seeding == (5, 1)


def test_a_tracker_not_seeded_by_rank_is_left_alone() -> None:
    tracker = RNGStatesTracker(CPU)
    tracker.add("mine", 11)
    context = CheckpointingContext(tracker=tracker, configured=False)
    context.use_tensor_axis(_axis(1))
    assert list(tracker.get_states()) == ["mine"]


def test_the_two_seeding_spellings_are_one_implementation() -> None:
    a, b = RNGStatesTracker(CPU), RNGStatesTracker(CPU)
    model_parallel_seed(a, TensorParallel(_axis(1)), 9)
    CheckpointingContext(tracker=b, tensor_axis=_axis(1)).model_parallel_manual_seed(9)
    assert torch.equal(_draw(a), _draw(b))
    with pytest.raises(ValueError, match="expected a non-negative integer"):
        model_parallel_seed(a, TensorParallel(_axis(0)), -1)


def _model(tracker: RNGStatesTracker) -> torch.nn.Module:
    tp = TensorParallel(_axis(0), tracker=tracker)
    return torch.nn.Sequential(TensorParallelDropout(0.5, None, "split", tp), TensorParallelDropout(0.5, None, "split"))


def test_checkpoint_rng_record_holds_the_trackers_and_old_records_still_load() -> None:
    own = RNGStatesTracker(CPU)
    model_parallel_seed(own, TensorParallel(_axis(1)), 3)
    checkpointing.model_parallel_manual_seed(4)
    model = _model(own)
    assert model_rng_trackers(model) == [own]
    record = capture_rng(model_rng_trackers(model))
    expected = (_draw(own), _draw(checkpointing.get_rng_tracker()), torch.rand(3))
    restore_rng(record, model_rng_trackers(model))
    assert torch.equal(_draw(own), expected[0])
    assert torch.equal(_draw(checkpointing.get_rng_tracker()), expected[1])
    assert torch.equal(torch.rand(3), expected[2])
    # a record from before the trackers were saved: the global generators come back, the trackers are untouched
    old = {k: v for k, v in capture_rng().items() if k != "trackers"}
    assert "trackers" not in capture_rng()
    after = own.get_states()
    _ = torch.rand(3)
    restore_rng(old, model_rng_trackers(model))
    assert all(torch.equal(after[k], v) for k, v in own.get_states().items())


def test_a_model_with_other_trackers_keeps_its_streams_with_a_warning(caplog) -> None:
    own = RNGStatesTracker(CPU)
    model_parallel_seed(own, TensorParallel(_axis(0)), 3)
    record = capture_rng([own, RNGStatesTracker(CPU)])
    before = own.get_states()
    _draw(own)
    moved = own.get_states()
    with caplog.at_level(logging.WARNING):
        restore_rng(record, [own])
    assert "2 model RNG tracker(s) but the model has 1" in caplog.text
    assert all(torch.equal(moved[k], v) for k, v in own.get_states().items())
    assert not all(torch.equal(before[k], v) for k, v in own.get_states().items())


def test_sequence_region_is_split_only_under_sequence_parallelism() -> None:
    tracker = RNGStatesTracker(CPU)
    sp = TensorParallel(_axis(0), sequence_parallel=True)
    drop = SequenceParallelDropout(0.5, sp, tracker)
    assert isinstance(drop, TensorParallelDropout) and drop.region == "sequence" and drop._stream() == "split"
    assert TensorParallelDropout(0.5, None, "sequence", TensorParallel(_axis(0)))._stream() == "replicated"
    one_rank = TensorParallel(_axis(0, 1), sequence_parallel=True)  # TP=1: nothing is split
    assert TensorParallelDropout(0.5, None, "sequence", one_rank)._stream() == "replicated"
    with pytest.raises(ValueError, match="needs tp="):
        TensorParallelDropout(0.5, tracker, "sequence")
