from __future__ import annotations

import itertools
import random

import pytest

from shardspeed.zero.layout import build_shard_layout, intersect, padded_size


def _random_sizes(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 1, 3, 7, 13, 64, 100, 1000]) for _ in range(count)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 16, 64])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bucket", [1, 50, 128, 10_000])
def test_layout_invariants(world: int, seed: int, bucket: int) -> None:
    numels = _random_sizes(seed, 12)
    groups = sorted(random.Random(seed).choice([0, 1, 2]) for _ in numels)
    layout = build_shard_layout(numels, groups, bucket, world)
    # every parameter sits in exactly one bucket, whole, and buckets never mix groups
    seen = []
    for b in layout.buckets:
        assert b.numel % world == 0 and b.numel >= world
        assert len({groups[i] for i in b.members}) == 1
        for i in b.members:
            lo, hi = layout.span(i)
            assert b.start <= lo <= hi <= b.end
            seen.append(i)
        used = sum(numels[i] for i in b.members)
        assert used <= bucket or len(b.members) == 1  # only a lone oversized parameter exceeds the bucket size
        assert b.numel - used < world or used == 0  # padding is less than one element per rank
    assert seen == list(range(len(numels)))
    assert all(a.end == b.start for a, b in itertools.pairwise(layout.buckets))
    # rank slices tile every bucket; shard offsets tile the shard buffer identically on all ranks
    for k, b in enumerate(layout.buckets):
        slices = [layout.rank_slice(k, r) for r in range(world)]
        assert slices[0][0] == b.start and slices[-1][1] == b.end
        assert all(x[1] == y[0] for x, y in itertools.pairwise(slices))
        lo, hi = layout.shard_offset(k)
        assert hi - lo == b.numel // world
    assert layout.shard_offset(len(layout.buckets) - 1)[1] == layout.shard_numel
    assert layout.shard_numel * world == layout.total
    # owned pieces of every parameter cover it exactly once across ranks
    for i, n in enumerate(numels):
        covered = sorted(r for r in (layout.owner_ranges(i, q) for q in range(world)) if r)
        assert sum(hi - lo for lo, hi in covered) == n


def test_small_example() -> None:
    layout = build_shard_layout([4, 4, 10, 1, 1, 1], [0, 0, 0, 0, 0, 1], 8, world=2)
    assert [(b.start, b.end, b.members, b.group) for b in layout.buckets] == [
        (0, 8, (0, 1), 0),
        (8, 18, (2,), 0),
        (18, 20, (3, 4), 0),  # group change closes the bucket
        (20, 22, (5,), 1),  # 1 element padded to 2
    ]
    assert layout.rank_slice(1, 1) == (13, 18)
    assert layout.shard_offset(1) == (4, 9)
    assert layout.padding == 1


def test_padding_and_errors() -> None:
    assert padded_size(10, 4) == 12
    assert padded_size(0, 4) == 4
    assert padded_size(10, 4, alignment=2) == 16
    with pytest.raises(ValueError, match="bucket size"):
        build_shard_layout([1], [0], 0)
    assert intersect((0, 5), (3, 9)) == (3, 5)
    assert intersect((0, 3), (3, 9)) is None
