"""Flat-buffer layout math: where each parameter lives in a flat buffer, buckets, and per-rank shards.

Pure functions of parameter sizes and world size — no tensors, no process groups — so they are tested over many
world sizes without starting processes. Everything that packs parameters or gradients into flat buffers (stage 0
buckets, master weights, ZeRO partitions) takes its offsets from here, so the buffers always line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed back to back: parameter ``i`` occupies ``[offsets[i], offsets[i] + numels[i])``."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, numels: Sequence[int]) -> FlatLayout:
        offsets, running = [], 0
        for n in numels:
            if n < 0:
                raise ValueError(f"negative parameter size {n}")
            offsets.append(running)
            running += n
        return cls(tuple(numels), tuple(offsets))

    @property
    def total(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    def span(self, index: int) -> tuple[int, int]:
        return self.offsets[index], self.offsets[index] + self.numels[index]


def padded_size(total: int, world_size: int, alignment: int = 1) -> int:
    """Smallest size ≥ ``total`` that splits into ``world_size`` equal shards, each a multiple of ``alignment``."""
    if world_size < 1 or alignment < 1:
        raise ValueError(f"world_size and alignment must be >= 1, got {world_size}, {alignment}")
    unit = world_size * alignment
    return max(unit, -(-total // unit) * unit)


def shard_range(padded_total: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank's equal shard of a padded flat buffer."""
    if padded_total % world_size:
        raise ValueError(f"padded size {padded_total} is not divisible by world size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    shard = padded_total // world_size
    return rank * shard, (rank + 1) * shard


def bucket_spans(layout: FlatLayout, bucket_numel: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Split the flat buffer into consecutive buckets of at most ``bucket_numel`` elements.

    Returns ``(start, end, param_indices)`` per bucket. Parameters are never split across buckets: a parameter
    bigger than ``bucket_numel`` gets a bucket of its own. Zero-size parameters join the current bucket.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    spans: list[tuple[int, int, tuple[int, ...]]] = []
    members: list[int] = []
    start = 0
    for i, n in enumerate(layout.numels):
        end = layout.offsets[i]
        if members and end + n - start > bucket_numel:
            spans.append((start, end, tuple(members)))
            members, start = [], end
        members.append(i)
    if members:
        spans.append((start, layout.total, tuple(members)))
    return spans


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Overlap of two half-open ranges, or None."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None
