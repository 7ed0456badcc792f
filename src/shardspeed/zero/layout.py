"""Flat-buffer layout math: where each parameter lives in a flat buffer, buckets, and per-rank shards.

Pure functions of parameter sizes and world size — no tensors, no process groups — so they are tested over many
world sizes without starting processes. Everything that packs parameters or gradients into flat buffers (stage 0
buckets, master weights, ZeRO partitions) takes its offsets from here, so the buffers always line up.

[Note: bucket-major sharding] A ZeRO partition is not one contiguous 1/N slice of the whole model: each bucket is
padded to a multiple of N and every rank owns the same 1/N slice *of every bucket*. Gradient buckets can then be
reduce-scattered and parameter buckets all-gathered with one equal-split collective each, moving exactly
(N-1)/N of the bucket — the paper's 2Ψ per step — while backward is still running. With one contiguous slice
per rank, a bucket straddling shard boundaries would need uneven reductions (gloo has no uneven reduce-scatter)
or an all-reduce (twice the traffic). A rank's shard buffer is its slices of all buckets, back to back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSpan:
    """Bucket ``[start, end)`` of the flat buffer (end includes padding) holding parameters ``members``."""

    start: int
    end: int
    members: tuple[int, ...]
    group: int  # optimizer parameter group of every member (buckets never mix groups)

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardLayout:
    """Parameters packed into buckets, each bucket padded to a multiple of ``world`` and split evenly."""

    world: int
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    buckets: tuple[BucketSpan, ...]

    @property
    def total(self) -> int:
        """Padded size of the flat buffer."""
        return self.buckets[-1].end if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (its shard buffer size)."""
        return self.total // self.world

    @property
    def padding(self) -> int:
        return self.total - sum(self.numels)

    @property
    def placement(self) -> tuple[int, ...]:
        """Parameter indices in the order they sit in the flat buffer (bucket by bucket)."""
        return tuple(i for b in self.buckets for i in b.members)

    def span(self, index: int) -> tuple[int, int]:
        return self.offsets[index], self.offsets[index] + self.numels[index]

    def rank_slice(self, bucket: int, rank: int) -> tuple[int, int]:
        """Flat-buffer range of ``rank``'s share of ``bucket``."""
        b = self.buckets[bucket]
        share = b.numel // self.world
        return b.start + rank * share, b.start + (rank + 1) * share

    def shard_offset(self, bucket: int) -> tuple[int, int]:
        """Range of ``bucket``'s share inside a rank's shard buffer (the same on every rank)."""
        b = self.buckets[bucket]
        return b.start // self.world, b.end // self.world

    def owner_ranges(self, index: int, rank: int) -> tuple[int, int] | None:
        """The part of parameter ``index`` (as a range of its flattened elements) that ``rank`` owns, if any."""
        lo, hi = self.span(index)
        for i, b in enumerate(self.buckets):
            if b.start <= lo < b.end:
                owned = intersect((lo, hi), self.rank_slice(i, rank))
                return (owned[0] - lo, owned[1] - lo) if owned else None
        return None


def build_shard_layout(
    numels: Sequence[int],
    groups: Sequence[int],
    bucket_numel: int,
    world: int = 1,
    order: Sequence[int] | None = None,
) -> ShardLayout:
    """Pack parameters into buckets of at most ``bucket_numel`` elements, placed in ``order`` (a permutation of
    parameter indices; default: index order). Offsets and spans stay indexed by parameter index.

    A parameter is never split across buckets: one bigger than ``bucket_numel`` gets a bucket of its own. A new
    bucket starts whenever the parameter group changes (so groups interleave when ``order`` interleaves them).
    Each bucket is padded to a multiple of ``world``.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if len(numels) != len(groups):
        raise ValueError("numels and groups must have the same length")
    if order is None:
        order = range(len(numels))
    elif sorted(order) != list(range(len(numels))):
        raise ValueError(f"order must be a permutation of 0..{len(numels) - 1}, got {list(order)}")
    offsets = [0] * len(numels)
    buckets: list[BucketSpan] = []
    members: list[int] = []
    start = cursor = 0

    def close() -> None:
        nonlocal start, cursor, members
        end = start + padded_size(cursor - start, world)
        buckets.append(BucketSpan(start, end, tuple(members), groups[members[0]]))
        start = cursor = end
        members = []

    for i in order:
        n = numels[i]
        if n < 0:
            raise ValueError(f"negative parameter size {n}")
        if members and (cursor + n - start > bucket_numel or groups[i] != groups[members[0]]):
            close()
        offsets[i] = cursor
        members.append(i)
        cursor += n
    if members:
        close()
    return ShardLayout(world, tuple(numels), tuple(offsets), tuple(buckets))


def padded_size(total: int, world_size: int, alignment: int = 1) -> int:
    """Smallest size ≥ ``total`` (and ≥ one element per rank) splitting into ``world_size`` equal shards."""
    if world_size < 1 or alignment < 1:
        raise ValueError(f"world_size and alignment must be >= 1, got {world_size}, {alignment}")
    unit = world_size * alignment
    return max(unit, -(-total // unit) * unit)


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Overlap of two half-open ranges, or None."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None
