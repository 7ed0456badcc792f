"""Bucket layout in a given order, the order agreement, and the reducer's bounded, arrival-ordered launches
(single process: a fake GradSync stands in for the collectives)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from shardspeed.comm import Work
from shardspeed.zero.arrival_order import LayoutPlanner, agree_on_order, complete_order
from shardspeed.zero.layout import build_shard_layout
from shardspeed.zero.reducer import REDUCTIONS_IN_FLIGHT, GradReducer


def test_order_places_parameters_and_keeps_offsets_by_index() -> None:
    layout = build_shard_layout([4, 3, 5, 2], [0, 0, 0, 0], 8, world=2, order=[2, 0, 3, 1])
    assert layout.placement == (2, 0, 3, 1)
    assert [b.members for b in layout.buckets] == [(2,), (0, 3), (1,)]  # 5+4 > 8: a new bucket
    assert layout.span(2) == (0, 5) and layout.span(0) == (6, 10)  # bucket 0 padded 5 -> 6
    assert layout.span(3) == (10, 12) and layout.span(1) == (12, 15)


def test_groups_interleave_in_arrival_order() -> None:
    """A new bucket starts when the group changes, but groups are not forced to be contiguous (no-decay
    buckets are not all pushed to the end)."""
    numels, groups = [4, 1, 4, 1], [0, 1, 0, 1]  # weight, bias, weight, bias
    layout = build_shard_layout(numels, groups, 100, order=[2, 3, 0, 1])
    assert [(b.members, b.group) for b in layout.buckets] == [((2,), 0), ((3,), 1), ((0,), 0), ((1,), 1)]
    layout = build_shard_layout(numels, groups, 100, order=[2, 0, 3, 1])
    assert [(b.members, b.group) for b in layout.buckets] == [((2, 0), 0), ((3, 1), 1)]


def test_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        build_shard_layout([1, 2], [0, 0], 8, order=[0, 0])


def test_complete_order_appends_unused_in_current_placement() -> None:
    layout = build_shard_layout([1, 1, 1, 1], [0, 0, 0, 0], 8, order=[3, 2, 1, 0])
    assert complete_order([1, 0], layout) == [1, 0, 3, 2]


class _FakeCollectives:
    def __init__(self, everyone: list[object]) -> None:
        self.everyone = everyone

    def all_gather_object(self, obj: object, axis: Any) -> list[object]:
        return [obj, *self.everyone[1:]]


def test_agreement_takes_rank0_order_and_checks_every_ranks_parameters() -> None:
    layout = LayoutPlanner((1, 1, 1), (0, 0, 0), 8, 1).build()
    names = ("a", "b", "c")
    collectives = _FakeCollectives([None, (names, [0, 1, 2])])
    assert agree_on_order([2, 1], names, layout, collectives, None) == [2, 1, 0]  # type: ignore[arg-type]
    collectives = _FakeCollectives([None, (("a", "b", "x"), [0, 1, 2])])
    with pytest.raises(RuntimeError, match=r"rank 1 packs other trainable parameters than rank 0 \(\['c', 'x'\]\)"):
        agree_on_order([2, 1], names, layout, collectives, None)  # type: ignore[arg-type]


class _FakeSync:
    """Counts launches in flight; records what was absorbed and launched, and how far backward had got."""

    def __init__(self) -> None:
        self.absorbed: list[int] = []
        self.launched: list[tuple[int, int]] = []  # (bucket, gradients absorbed so far)
        self.in_flight = self.max_in_flight = 0

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        self.absorbed.append(index)

    def launch(self, bucket: int) -> Work:
        self.launched.append((bucket, len(self.absorbed)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return Work(None)

    def complete(self, bucket: int) -> None:
        self.in_flight -= 1

    def zero(self) -> None:
        pass

    def forget(self, index: int) -> None:
        pass

    def reopen(self) -> None:
        pass


def _chain(depth: int = 6) -> tuple[torch.nn.Sequential, list[torch.nn.Parameter], list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(depth)])
    named = list(model.named_parameters())
    return model, [p for _, p in named], [n for n, _ in named]


def _backward(model: torch.nn.Module, reducer: GradReducer) -> None:
    reducer.before_backward(communicate=True, final=True)
    model(torch.randn(2, 4)).sum().backward()
    reducer.after_backward()


def test_reducer_keeps_at_most_the_cap_in_flight_during_backward() -> None:
    model, params, names = _chain()
    layout = build_shard_layout([p.numel() for p in params], [0] * 6, 16, order=[5, 4, 3, 2, 1, 0])  # backward order
    sync = _FakeSync()
    reducer = GradReducer(params, names, layout, sync)
    _backward(model, reducer)
    assert sync.max_in_flight == REDUCTIONS_IN_FLIGHT == 2
    assert [k for k, _ in sync.launched] == list(range(6))
    assert [n for _, n in sync.launched] == [1, 2, 3, 4, 5, 6]  # each bucket launched as soon as it was complete
    assert reducer.reduced and sync.in_flight == 0


def test_recording_backward_relays_out_then_replays_in_the_new_bucket_order(caplog) -> None:
    model, params, names = _chain()
    numels = [p.numel() for p in params]
    layout = build_shard_layout(numels, [0] * 6, 16)  # registration order: the opposite of backward's
    sync = _FakeSync()
    reducer = GradReducer(params, names, layout, sync)
    seen: list[list[int]] = []

    def plan(arrived: list[int]) -> bool:
        seen.append(arrived)
        reducer.set_layout(build_shard_layout(numels, [0] * 6, 16, order=arrived), sync)
        return True

    reducer.plan_layout = plan
    _backward(model, reducer)
    assert seen == [[5, 4, 3, 2, 1, 0]]  # recorded, not absorbed, during backward
    assert sync.absorbed == [5, 4, 3, 2, 1, 0]  # replayed in the new layout's order
    assert sync.max_in_flight == 2 and reducer.reduced
    assert reducer.plan_layout is None  # planned once
    sync.absorbed.clear()
    sync.launched.clear()
    _backward(model, reducer)
    assert [n for _, n in sync.launched] == [1, 2, 3, 4, 5, 6]  # second backward: launches overlap backward
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        reducer.before_backward(communicate=True)
        model[::-1](torch.randn(2, 4)).sum().backward()  # another order now: logged once, not re-laid out
        reducer.after_backward()
        reducer.before_backward(communicate=True)
        model[::-1](torch.randn(2, 4)).sum().backward()
        reducer.after_backward()
    assert sum("arrival order changed" in r.getMessage() for r in caplog.records) == 1


def _shards(values: list[torch.Tensor], layout: Any, world: int) -> list[torch.Tensor]:
    """Every rank's bucket-major shard of per-parameter ``values`` under ``layout`` (padding zero)."""
    flat = torch.zeros(layout.total)
    for i, v in enumerate(values):
        lo, hi = layout.span(i)
        flat[lo:hi] = v
    return [
        torch.cat([flat[slice(*layout.rank_slice(k, r))] for k in range(len(layout.buckets))]) for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_reshard_moves_each_ranks_elements_to_the_new_layout(world: int) -> None:
    from shardspeed.zero.relayout_state import reshard

    numels, groups = [5, 3, 7, 1, 4], [0, 1, 0, 1, 0]
    values = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    old = build_shard_layout(numels, groups, 9, world)
    new = build_shard_layout(numels, groups, 9, world, order=[4, 3, 2, 0, 1])
    old_shards, new_shards = _shards(values, old, world), _shards(values, new, world)
    everyone = torch.cat(old_shards)
    for rank in range(world):
        moved = reshard(old_shards[rank], old, new, rank, lambda _: everyone)
        assert torch.equal(moved, new_shards[rank])
