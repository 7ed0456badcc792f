"""Box math for N-d checkpoints: where a flat range of one box of a global tensor lies in another box. Pure.

A checkpoint stores each tensor as *boxes* of its global shape (an offset per dim and a shape: a tensor-parallel
rank's slice, or the whole tensor), each box tiled by 1-D chunks that are flat ranges ``[start, end)`` of the box in
its own row-major (lexicographic) order. Saving cuts a rank's ZeRO shard (a flat range of its *local* parameter)
per box; loading fills a target range from every saved box that intersects it.

[Note: flat ranges of boxes restrict to flat ranges] The elements of a sub-box, listed in the sub-box's own
row-major order, appear in the same relative order in the enclosing box's row-major order (translating
multi-indices by an offset keeps lexicographic order). So the elements of a flat range ``[a, b)`` of a box that lie
in a sub-box are *one* contiguous flat range of the sub-box: ``[#sub-box elements before a, #before b)``
(``count_before``). That keeps every record "a flat range of one box" however ZeRO's flat shards cut TP boxes, and
makes an overlap between a saved range and a target range one interval of their intersection box, from which both
sides' positions follow by index arithmetic bounded by the overlap's size (``overlaps``). When the interval maps to
contiguous positions on both sides — every DP-only checkpoint, and column (dim 0) slices — it is a plain slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

Shape = tuple[int, ...]


@dataclass(frozen=True)
class BoxRef:
    """An axis-aligned block: ``shape`` elements starting at ``offset`` (in some enclosing tensor's coordinates)."""

    offset: Shape
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"box offset {list(self.offset)} and shape {list(self.shape)} differ in rank")
        if any(o < 0 for o in self.offset) or any(s < 0 for s in self.shape):
            raise ValueError(f"box offset {list(self.offset)} / shape {list(self.shape)} has a negative entry")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def relative_to(self, outer: BoxRef) -> BoxRef:
        """This box in ``outer``'s coordinates (it must lie inside ``outer``)."""
        return BoxRef(tuple(o - p for o, p in zip(self.offset, outer.offset)), self.shape)

    def inside(self, shape: Sequence[int]) -> bool:
        """Whether this box lies within a tensor of ``shape``."""
        return len(shape) == len(self.shape) and all(o + s <= d for o, s, d in zip(self.offset, self.shape, shape))


def whole(shape: Sequence[int]) -> BoxRef:
    """The box covering a whole tensor of ``shape``."""
    return BoxRef((0,) * len(shape), tuple(shape))


def intersect(a: BoxRef, b: BoxRef) -> BoxRef | None:
    """The common block of two boxes (same coordinates), or None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offset, a.shape, b.offset, b.shape))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return BoxRef(lo, tuple(h - low for low, h in zip(lo, hi)))


def count_before(outer_shape: Sequence[int], flat: int, sub: BoxRef) -> int:
    """How many elements of ``sub`` (a box in the coordinates of a tensor of ``outer_shape``) precede flat position
    ``flat`` of that tensor in row-major order; ``flat`` may be the tensor's numel (then: all of ``sub``)."""
    if flat >= math.prod(outer_shape):
        return sub.numel
    index = []
    for size in reversed(outer_shape):
        flat, coordinate = divmod(flat, size)
        index.append(coordinate)
    index.reverse()
    count = 0
    for k, (m, lo, width) in enumerate(zip(index, sub.offset, sub.shape)):
        inner = math.prod(sub.shape[k + 1 :])
        if m < lo:  # every sub-box element with this prefix comes later
            return count
        if m >= lo + width:  # every one with this prefix comes earlier
            return count + width * inner
        count += (m - lo) * inner
    return count


def restrict(outer_shape: Sequence[int], start: int, end: int, sub: BoxRef) -> tuple[int, int]:
    """The flat range ``[start, end)`` of a tensor of ``outer_shape``, restricted to ``sub``: a flat range of ``sub``
    ([Note: flat ranges of boxes restrict to flat ranges])."""
    return count_before(outer_shape, start, sub), count_before(outer_shape, end, sub)


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def sub_to_outer(outer_shape: Sequence[int], sub: BoxRef, index: int) -> int:
    """Flat position in the tensor of ``outer_shape`` of ``sub``'s element at flat position ``index``."""
    out = 0
    for size, offset, stride in zip(reversed(sub.shape), reversed(sub.offset), reversed(_strides(outer_shape))):
        index, coordinate = divmod(index, size)
        out += (coordinate + offset) * stride
    return out


def sub_to_outer_many(outer_shape: Sequence[int], sub: BoxRef, index: torch.Tensor) -> torch.Tensor:
    """``sub_to_outer`` for a tensor of int64 positions."""
    out = torch.zeros_like(index)
    rest = index.clone()
    for size, offset, stride in zip(reversed(sub.shape), reversed(sub.offset), reversed(_strides(outer_shape))):
        out += (rest % size + offset) * stride
        rest = rest.div(size, rounding_mode="floor")
    return out


@dataclass(frozen=True)
class Transfer:
    """``count`` elements move from a source range to a target range. Positions are relative to each range's
    start. ``src_index``/``dst_index`` None: both sides are contiguous from ``src_start``/``dst_start``; else int64
    positions (ascending), ``src_start``/``dst_start`` their first entries."""

    count: int
    src_start: int
    dst_start: int
    src_index: torch.Tensor | None = None
    dst_index: torch.Tensor | None = None

    @property
    def src_span(self) -> int:
        """Source elements from the first to the last one moved (what a read of the source must cover)."""
        return self.count if self.src_index is None else int(self.src_index[-1]) - self.src_start + 1


def overlaps(
    src: BoxRef, src_start: int, src_end: int, dst: BoxRef, dst_start: int, dst_end: int, block: int = 1 << 20
) -> Iterator[Transfer]:
    """How elements ``[src_start, src_end)`` of box ``src`` fill elements ``[dst_start, dst_end)`` of box ``dst``
    (both boxes in global coordinates, ranges in each box's flat order): ``Transfer``s of at most ``block`` elements,
    in order. Nothing when the two share no element."""
    common = intersect(src, dst)
    if common is None:
        return
    in_src, in_dst = common.relative_to(src), common.relative_to(dst)
    a1, b1 = restrict(src.shape, src_start, src_end, in_src)
    a2, b2 = restrict(dst.shape, dst_start, dst_end, in_dst)
    lo, hi = max(a1, a2), min(b1, b2)
    for first in range(lo, hi, block):
        last = min(first + block, hi) - 1
        s0, s1 = sub_to_outer(src.shape, in_src, first), sub_to_outer(src.shape, in_src, last)
        d0, d1 = sub_to_outer(dst.shape, in_dst, first), sub_to_outer(dst.shape, in_dst, last)
        count = last - first + 1
        # positions grow strictly with the index, so equal spans mean steps of exactly one: contiguous
        if s1 - s0 == count - 1 and d1 - d0 == count - 1:
            yield Transfer(count, s0 - src_start, d0 - dst_start)
            continue
        positions = torch.arange(first, last + 1, dtype=torch.int64)
        src_index = sub_to_outer_many(src.shape, in_src, positions) - src_start
        dst_index = sub_to_outer_many(dst.shape, in_dst, positions) - dst_start
        yield Transfer(count, s0 - src_start, d0 - dst_start, src_index, dst_index)


def local_runs(local_shape: Sequence[int], start: int, end: int, local_box: BoxRef) -> tuple[int, int, Transfer | None]:
    """Where the flat range ``[start, end)`` of a local parameter meets one of its boxes (``local_box`` in local
    coordinates): the box's flat range ``[a, b)`` and how its elements sit in the parameter's range (a ``Transfer``
    from box positions relative to ``a`` to parameter positions relative to ``start``; None when empty)."""
    a, b = restrict(local_shape, start, end, local_box)
    if a >= b:
        return a, b, None
    first, last = sub_to_outer(local_shape, local_box, a), sub_to_outer(local_shape, local_box, b - 1)
    if last - first == b - 1 - a:
        return a, b, Transfer(b - a, 0, first - start)
    positions = sub_to_outer_many(local_shape, local_box, torch.arange(a, b, dtype=torch.int64)) - start
    return a, b, Transfer(b - a, 0, first - start, torch.arange(0, b - a, dtype=torch.int64), positions)
