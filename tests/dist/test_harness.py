from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is unhappy")


def test_two_ranks_all_reduce_fast(dist_run) -> None:
    dist_run(_sum_ranks, 2)  # warm-up
    start = time.monotonic()
    assert dist_run(_sum_ranks, 2) == [3.0, 3.0]
    assert time.monotonic() - start < 1.0


def test_four_ranks(dist_run) -> None:
    assert dist_run(_sum_ranks, 4) == [10.0] * 4


def test_failure_is_reported_with_rank(dist_run) -> None:
    with pytest.raises(RankFailure, match="rank 1: ValueError: rank one is unhappy") as info:
        dist_run(_fail_on_one, 2)
    assert list(info.value.errors) == [1]
