from __future__ import annotations

import itertools

import pytest

from shardspeed.zero.layout import FlatLayout, bucket_spans, intersect, padded_size, shard_range


def test_flat_layout_offsets() -> None:
    layout = FlatLayout.of([3, 0, 5, 2])
    assert layout.offsets == (0, 3, 3, 8)
    assert layout.total == 10
    assert layout.span(2) == (3, 8)
    assert FlatLayout.of([]).total == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("total", [1, 5, 63, 64, 1000, 12345])
def test_padding_and_shards_cover_everything(world: int, total: int) -> None:
    padded = padded_size(total, world)
    assert (padded >= total and padded % world == 0 and padded - total < world) or padded == world
    ranges = [shard_range(padded, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert len({e - s for s, e in ranges}) == 1


def test_padding_alignment() -> None:
    assert padded_size(10, 4, alignment=2) == 16
    with pytest.raises(ValueError, match="not divisible"):
        shard_range(10, 4, 0)


def test_buckets_never_split_params_and_respect_size() -> None:
    layout = FlatLayout.of([4, 4, 10, 1, 1, 1])
    spans = bucket_spans(layout, 8)
    assert spans == [(0, 8, (0, 1)), (8, 18, (2,)), (18, 21, (3, 4, 5))]
    # every parameter in exactly one bucket, buckets contiguous
    assert sorted(i for _, _, m in spans for i in m) == list(range(6))
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_intersect() -> None:
    assert intersect((0, 5), (3, 9)) == (3, 5)
    assert intersect((0, 3), (3, 9)) is None
