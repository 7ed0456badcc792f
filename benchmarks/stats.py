"""Pure statistics for the benchmarks: per-round ratios, their median and interquartile range.

Why ratios per round rather than a ratio of overall means: the machine's speed drifts (other processes,
thermal state, page cache), and both rows of one round run back to back under nearly the same conditions. A
ratio taken inside each round cancels most of that drift; the median and IQR over rounds then say how
stable it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _checked(values: Sequence[float], name: str) -> list[float]:
    items = [float(v) for v in values]
    if not items:
        raise ValueError(f"{name} is empty: need at least one value")
    bad = [v for v in items if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{name} holds a non-finite value ({bad[0]!r}); every value must be a finite number")
    return items


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean of a non-empty sequence."""
    items = _checked(values, "values")
    return sum(items) / len(items)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100), interpolating linearly between the two nearest order statistics.

    The position of the q-th percentile among the n sorted values is ``q/100 · (n − 1)`` (0-based); a
    fractional position is interpolated. This is the common "linear" definition (numpy's default), so a reader
    can check a printed IQR with any spreadsheet.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q!r} is out of range; valid: 0 <= q <= 100")
    ordered = sorted(_checked(values, "values"))
    position = q / 100.0 * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


def median(values: Sequence[float]) -> float:
    """The 50th percentile: the middle value, or the mean of the two middle values for an even count."""
    return percentile(values, 50.0)


def interquartile_range(values: Sequence[float]) -> tuple[float, float]:
    """(25th percentile, 75th percentile): the band holding the middle half of the values."""
    return percentile(values, 25.0), percentile(values, 75.0)


def per_round_ratios(row_times: Sequence[float], peer_times: Sequence[float]) -> list[float]:
    """row_time / peer_time for each round; below 1 means the row was faster than its peer in that round."""
    rows = _checked(row_times, "row_times")
    peers = _checked(peer_times, "peer_times")
    if len(rows) != len(peers):
        raise ValueError(
            f"row_times has {len(rows)} rounds but peer_times has {len(peers)}; "
            "ratios pair the two rows round by round, so the counts must match"
        )
    for index, peer in enumerate(peers):
        if peer <= 0.0:
            raise ValueError(f"peer_times[{index}] = {peer!r}; a step time must be positive")
    return [row / peer for row, peer in zip(rows, peers)]


@dataclass(frozen=True)
class RatioSummary:
    """How a row's step time compares with its peer's over all rounds."""

    per_round: tuple[float, ...]
    median: float
    q25: float
    q75: float


def summarize_ratios(row_times: Sequence[float], peer_times: Sequence[float]) -> RatioSummary:
    """Per-round ratios with their median and interquartile range."""
    ratios = per_round_ratios(row_times, peer_times)
    q25, q75 = interquartile_range(ratios)
    return RatioSummary(per_round=tuple(ratios), median=median(ratios), q25=q25, q75=q75)
