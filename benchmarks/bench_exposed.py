"""Exposed communication per step, from a shardspeed engine's ``collectives.blocked`` (pure: dicts in, dicts out).

[Note: exposed communication in the benchmark] ``BlockedTime`` (comm/blocked.py) holds the seconds the training
thread sat in a ``Work.wait()`` with a pending handle or in a synchronous collective, keyed ``"op:tag"``. The
benchmark resets it before each row's timed block and reads it after, so one round of one row gives seconds per
key over ``steps`` steps; each rank measures its own thread, and the figure kept is the mean over ranks (the
slowest rank's step time is the step time, but blocked time is per thread and ranks wait for each other, so the
mean is the fairer "what a rank pays"). Keys fall into three groups by tag: ``grads`` (gradient reduction),
``params`` (parameter gathers: stage 3's units, stages 1/2's post-step gather) and everything else (``other``:
the step's norm / overflow checks, loss averaging, ...). The report prints the median over rounds of each.

A wait ends when the peers' bytes have arrived, so it also holds the time the peers arrived late (rank skew):
on a loaded machine the first synchronous collective after a step (the step checks, stage 3's unit-id check)
absorbs the skew of everything before it. Compare before/after rows of the same run, not figures across runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stats import median

CATEGORIES = ("grads", "params", "other")


def category(key: str) -> str:
    """``"all_reduce:grads"`` → ``grads``; ``"all_gather:params"`` → ``params``; anything else → ``other``."""
    _, _, tag = key.partition(":")
    return tag if tag in ("grads", "params") else "other"


def per_step_ms(seconds_by_rank: Sequence[Mapping[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step per key, the mean over ranks (a key a rank never blocked in counts 0 there)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not seconds_by_rank:
        raise ValueError("seconds_by_rank is empty: need one mapping per rank")
    keys = sorted({key for rank in seconds_by_rank for key in rank})
    ranks = len(seconds_by_rank)
    return {key: sum(rank.get(key, 0.0) for rank in seconds_by_rank) / ranks * 1e3 / steps for key in keys}


def by_category(ms_by_key: Mapping[str, float]) -> dict[str, float]:
    """``{"total", "grads", "params", "other"}`` → ms per step."""
    out = dict.fromkeys(("total", *CATEGORIES), 0.0)
    for key, ms in ms_by_key.items():
        out[category(key)] += ms
        out["total"] += ms
    return out


def median_over_rounds(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per key, the median over rounds (a key missing from a round counts 0 in it)."""
    if not rounds:
        raise ValueError("rounds is empty: need at least one round")
    keys = sorted({key for one in rounds for key in one})
    return {key: median([one.get(key, 0.0) for one in rounds]) for key in keys}


def summarize(rounds: Sequence[Mapping[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """(median by category incl. total, median by op:tag key) over rounds of ms-per-step-by-key."""
    return median_over_rounds([by_category(one) for one in rounds]), median_over_rounds(rounds)
