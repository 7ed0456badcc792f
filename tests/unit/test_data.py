"""shardspeed.data: world-size-independent order, resumable position, prefetch accounting, RepeatingLoader.

Expected orders are computed here from first principles (``torch.randperm`` seeded with ``seed + epoch``, cut
into consecutive global batches), never by asking the sampler.
"""

from __future__ import annotations

import time
from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset

from shardspeed.data import (
    GlobalIndexSampler,
    RepeatingLoader,
    ShardSpeedDataLoader,
    build_dataloader,
    move_to_device,
)

SEED = 7
NUM_SAMPLES = 100
GLOBAL_BATCH = 8  # every world/micro/accumulation factorisation below multiplies to this


class IndexDataset(Dataset):
    """Sample i is the tensor [i]: a batch tells exactly which samples it holds."""

    def __init__(self, size: int = NUM_SAMPLES) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def expected_global_batches(epoch: int, *, seed: int = SEED, shuffle: bool = True) -> list[list[int]]:
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(NUM_SAMPLES, generator=generator).tolist()
    else:
        order = list(range(NUM_SAMPLES))
    whole = NUM_SAMPLES // GLOBAL_BATCH
    return [order[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH] for b in range(whole)]


def make_loaders(micro: int, accumulation: int, world: int, **kwargs: object) -> list[ShardSpeedDataLoader]:
    return [
        build_dataloader(
            IndexDataset(),
            micro_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            dp_rank=rank,
            dp_world_size=world,
            seed=SEED,
            **kwargs,
        )
        for rank in range(world)
    ]


def run_global_batches(iterators: list, accumulation: int, count: int) -> list[list[int]]:
    """Step all ranks in lockstep; join each step's micro-batches in (micro-step, rank) order."""
    batches = []
    for _ in range(count):
        samples: list[int] = []
        for _ in range(accumulation):
            for rank_iterator in iterators:
                samples += next(rank_iterator).flatten().tolist()
        batches.append(samples)
    return batches


FACTORISATIONS = [(2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 2, 4), (4, 1, 2)]  # (micro, accumulation, world)


@pytest.mark.parametrize(("micro", "accumulation", "world"), FACTORISATIONS)
def test_global_batches_do_not_depend_on_world_size(micro: int, accumulation: int, world: int) -> None:
    loaders = make_loaders(micro, accumulation, world)
    assert all(len(loader) == (NUM_SAMPLES // GLOBAL_BATCH) * accumulation for loader in loaders)
    iterators = [iter(loader) for loader in loaders]
    got = run_global_batches(iterators, accumulation, NUM_SAMPLES // GLOBAL_BATCH)
    assert got == expected_global_batches(0)
    for rank_iterator in iterators:  # the 4 leftover samples (100 = 12 × 8 + 4) are dropped
        with pytest.raises(StopIteration):
            next(rank_iterator)


def test_without_shuffle_the_order_is_the_identity() -> None:
    loaders = make_loaders(2, 2, 2, shuffle=False)
    got = run_global_batches([iter(loader) for loader in loaders], 2, 3)
    assert got == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]


def test_a_rank_reads_only_its_own_micro_batches() -> None:
    sampler = GlobalIndexSampler(
        NUM_SAMPLES, micro_batch_size=2, gradient_accumulation_steps=2, dp_rank=1, dp_world_size=2, seed=SEED
    )
    first_batch = expected_global_batches(0)[0]
    # layout [step 0: rank 0, rank 1 | step 1: rank 0, rank 1] with 2 samples each
    assert list(sampler)[:2] == [first_batch[2:4], first_batch[6:8]]


@pytest.mark.parametrize(("new_micro", "new_accumulation", "new_world"), [(2, 4, 1), (1, 2, 4), (2, 1, 4)])
def test_resume_mid_epoch_at_another_world_size_continues_with_the_same_samples(
    new_micro: int, new_accumulation: int, new_world: int
) -> None:
    old = make_loaders(2, 2, 2)
    old_iterators = [iter(loader) for loader in old]
    assert run_global_batches(old_iterators, 2, 3) == expected_global_batches(0)[:3]
    states = [loader.state_dict() for loader in old]
    assert all(state == states[0] for state in states), "the position is global, identical on every rank"
    assert states[0]["epoch"] == 0
    assert states[0]["samples_consumed_in_epoch"] == 3 * GLOBAL_BATCH

    new = make_loaders(new_micro, new_accumulation, new_world)
    for loader in new:
        loader.load_state_dict(states[0])
    rest = run_global_batches([iter(loader) for loader in new], new_accumulation, 12 - 3)
    assert rest == expected_global_batches(0)[3:]


def test_resume_mid_accumulation_needs_a_whole_micro_step_of_the_new_layout() -> None:
    old = make_loaders(2, 2, 2)  # one micro-step = 4 global samples
    for loader in old:
        next(iter(loader))
    state = old[0].state_dict()
    assert state["samples_consumed_in_epoch"] == 4

    fits = make_loaders(1, 2, 4)  # one micro-step = 4 samples too: continues inside the global batch
    for loader in fits:
        loader.load_state_dict(state)
    iterators = [iter(loader) for loader in fits]
    second_half = [sample for it in iterators for sample in next(it).flatten().tolist()]
    assert second_half == expected_global_batches(0)[0][4:8]

    too_coarse = make_loaders(2, 1, 4)[0]  # one micro-step = 8 samples: position 4 falls inside one
    with pytest.raises(ValueError, match=r"position 4 .*micro_batch_size 2 × data-parallel world size 4"):
        too_coarse.load_state_dict(state)


def test_the_position_counts_batches_received_not_batches_prefetched() -> None:
    (loader,) = make_loaders(2, 4, 1)
    iterator = iter(loader)
    received = [next(iterator).flatten().tolist() for _ in range(3)]
    deadline = time.monotonic() + 5
    while iterator.read_ahead < 1:  # let the prefetch thread read the 4th batch ahead
        assert time.monotonic() < deadline, "prefetch thread never read ahead"
        time.sleep(0.01)
    state = loader.state_dict()
    assert state["samples_consumed_in_epoch"] == 3 * 2

    (resumed,) = make_loaders(2, 4, 1)
    resumed.load_state_dict(state)
    flat_epoch = [s for batch in expected_global_batches(0) for s in batch]
    assert received == [flat_epoch[0:2], flat_epoch[2:4], flat_epoch[4:6]]
    assert next(iter(resumed)).flatten().tolist() == flat_epoch[6:8]
    assert next(iterator).flatten().tolist() == flat_epoch[6:8], "the original continues too"


def test_breaking_out_and_iterating_again_continues_and_stops_the_old_thread() -> None:
    (loader,) = make_loaders(2, 4, 1, shuffle=False)
    first = iter(loader)
    assert next(first).flatten().tolist() == [0, 1]
    first_thread = first._thread
    assert first_thread.is_alive()
    assert next(iter(loader)).flatten().tolist() == [2, 3]
    assert not first_thread.is_alive(), "the abandoned iterator's thread must stop"
    with pytest.raises(StopIteration):
        next(first)
    loader.close()


def test_finishing_an_epoch_moves_to_the_next_one() -> None:
    (loader,) = make_loaders(4, 2, 1)
    epoch0 = [s for batch in loader for s in batch.flatten().tolist()]
    assert epoch0 == [s for batch in expected_global_batches(0) for s in batch]
    assert loader.state_dict()["epoch"] == 1
    epoch1 = [s for batch in loader for s in batch.flatten().tolist()]
    assert epoch1 == [s for batch in expected_global_batches(1) for s in batch]


def test_a_position_at_the_very_end_of_an_epoch_resumes_at_the_next_epoch() -> None:
    (loader,) = make_loaders(4, 2, 1)
    iterator = iter(loader)
    for _ in range(len(loader)):
        next(iterator)
    assert loader.state_dict() == {**loader.state_dict(), "epoch": 1, "samples_consumed_in_epoch": 0}


def test_repeating_loader_runs_across_epochs_with_a_new_order_each() -> None:
    (loader,) = make_loaders(2, 4, 1)
    repeating = RepeatingLoader(loader)
    per_epoch = len(loader)
    taken = [next(repeating).flatten().tolist() for _ in range(2 * per_epoch + 3)]
    flat = [s for e in range(3) for batch in expected_global_batches(e) for s in batch]
    assert [s for batch in taken for s in batch] == flat[: (2 * per_epoch + 3) * 2]
    assert repeating.state_dict()["epoch"] == 2
    assert repeating.state_dict()["samples_consumed_in_epoch"] == 3 * 2


def test_repeating_loader_over_a_plain_iterable_and_an_empty_one() -> None:
    repeating = RepeatingLoader([1, 2, 3])
    assert [next(repeating) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(RuntimeError, match="yielded no batch"):
        next(RepeatingLoader([]))


def test_dataloader_workers_do_not_disturb_order_or_position() -> None:
    (loader,) = make_loaders(2, 4, 1, num_workers=1)
    iterator = iter(loader)
    got = [next(iterator).flatten().tolist() for _ in range(5)]
    flat = [s for batch in expected_global_batches(0) for s in batch]
    assert got == [flat[i : i + 2] for i in range(0, 10, 2)]
    assert loader.state_dict()["samples_consumed_in_epoch"] == 10
    loader.close()


Pair = namedtuple("Pair", ["inputs", "labels"])


def test_move_to_device_moves_every_tensor_in_nested_structures() -> None:
    batch = {
        "tokens": torch.ones(2, 3),
        "pair": Pair(torch.zeros(2), [torch.ones(1), "label-name", 3]),
        "extras": (torch.arange(4), None),
    }
    moved = move_to_device(batch, torch.device("meta"))
    assert type(moved) is dict and set(moved) == {"tokens", "pair", "extras"}
    assert moved["tokens"].device.type == "meta" and moved["tokens"].shape == (2, 3)
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].inputs.device.type == "meta"
    assert isinstance(moved["pair"].labels, list)
    assert moved["pair"].labels[0].device.type == "meta"
    assert moved["pair"].labels[1:] == ["label-name", 3]
    assert isinstance(moved["extras"], tuple) and moved["extras"][0].device.type == "meta"
    assert moved["extras"][1] is None
    assert batch["tokens"].device.type == "cpu", "the input is not modified"


class PairDataset(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, object]:
        return {"x": torch.full((3,), float(index)), "meta": (torch.tensor(index), [torch.tensor(-index)])}


def test_the_loader_delivers_nested_batches_on_its_device() -> None:
    loader = build_dataloader(
        PairDataset(),
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        dp_rank=0,
        dp_world_size=1,
        shuffle=False,
        device=torch.device("meta"),
    )
    batch = next(iter(loader))
    assert batch["x"].device.type == "meta" and batch["x"].shape == (4, 3)
    assert batch["meta"][0].device.type == "meta" and batch["meta"][1][0].device.type == "meta"
    loader.close()


def test_on_cpu_the_batch_is_not_copied() -> None:
    data = torch.arange(32.0).reshape(16, 2)
    loader = build_dataloader(
        data,  # a tensor is a map-style dataset; identity collate keeps the rows as they are
        micro_batch_size=16,
        gradient_accumulation_steps=1,
        dp_rank=0,
        dp_world_size=1,
        shuffle=False,
        collate_fn=lambda rows: rows,
        device=torch.device("cpu"),
    )
    rows = next(iter(loader))
    assert all(row.data_ptr() == data[i].data_ptr() for i, row in enumerate(rows))
    loader.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetch_copies_from_pinned_memory() -> None:
    loader = build_dataloader(
        PairDataset(),
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        dp_rank=0,
        dp_world_size=1,
        device=torch.device("cuda", 0),
    )
    assert loader._torch_loader.pin_memory
    seen = [batch["x"][:, 0].cpu().tolist() for batch in loader]
    assert all(len(x) == 4 for x in seen) and sorted(v for x in seen for v in x) == [float(i) for i in range(16)]


class FailingDataset(IndexDataset):
    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise KeyError(f"sample {index} is corrupt")
        return super().__getitem__(index)


def test_an_error_in_the_dataset_reaches_the_consumer() -> None:
    loader = build_dataloader(
        FailingDataset(),
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        dp_rank=0,
        dp_world_size=1,
        shuffle=False,
    )
    iterator = iter(loader)
    assert next(iterator).flatten().tolist() == [0, 1]
    assert next(iterator).flatten().tolist() == [2, 3]
    with pytest.raises(KeyError, match="sample 5 is corrupt"):
        next(iterator)
    assert loader.state_dict()["samples_consumed_in_epoch"] == 4


def test_a_dataset_smaller_than_one_global_batch_is_padded_to_one() -> None:
    """DeepSpeed runs a dataset smaller than one global batch (its sampler pads by repeating samples); so do we:
    one global batch per epoch, the order cycled, every rank the same number of full micro-batches."""
    got = {}
    for rank in (0, 1):
        loader = build_dataloader(
            IndexDataset(10),
            micro_batch_size=4,
            gradient_accumulation_steps=2,
            dp_rank=rank,
            dp_world_size=2,
            shuffle=False,
        )
        assert len(loader) == 2
        got[rank] = [batch.flatten().tolist() for batch in loader]
    assert got[0] == [[0, 1, 2, 3], [8, 9, 0, 1]]
    assert got[1] == [[4, 5, 6, 7], [2, 3, 4, 5]]


def test_an_empty_dataset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"the dataset is empty \(0 samples\)"):
        build_dataloader(IndexDataset(0), micro_batch_size=4, gradient_accumulation_steps=2, dp_rank=0, dp_world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer, got 0"),
        ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps must be a positive integer"),
        ({"dp_rank": 2}, r"dp_rank must be an integer in \[0, 2\), got 2"),
        ({"num_workers": -1}, "num_workers must be a non-negative integer, got -1"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    arguments = {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "dp_rank": 0, "dp_world_size": 2}
    with pytest.raises(ValueError, match=message):
        build_dataloader(IndexDataset(), **{**arguments, **kwargs})


def test_a_dataset_without_length_is_rejected() -> None:
    with pytest.raises(ValueError, match="map-style dataset with __len__"):
        build_dataloader(iter(range(10)), micro_batch_size=1, gradient_accumulation_steps=1, dp_rank=0, dp_world_size=1)


def test_a_state_for_another_dataset_size_is_rejected() -> None:
    (loader,) = make_loaders(2, 4, 1)
    state = {**loader.state_dict(), "num_samples": 99}
    with pytest.raises(ValueError, match="dataset of 99 samples but this dataset has 100"):
        loader.load_state_dict(state)


def test_an_abandoned_iterator_stops_its_thread_when_collected() -> None:
    (loader,) = make_loaders(2, 4, 1)
    iterator = iter(loader)
    next(iterator)
    thread = iterator._thread
    loader._live = None  # drop every reference: the thread itself must not keep the iterator alive
    del iterator
    thread.join(timeout=2)
    assert not thread.is_alive()
