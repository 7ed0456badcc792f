"""Config errors: one exception type, the nearest-name suggestion every config error uses, and the misspelling
rule for unknown config keys (``misspelling_of``: Damerau-Levenshtein distance <= 2)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A user's config is wrong. The message names the key path, the bad value and what would be valid.

    Raised during parsing, before any collective, and identically on every rank (parsing is a pure
    function of the config and the world size), so a bad config is an error on all ranks, not a hang.
    """


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (a likely misspelling), or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    if matches:
        return matches[0]
    lowered = {c.lower(): c for c in candidates}
    return lowered.get(name.lower())


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean "x"?)' or '' — appended to unknown-name errors."""
    guess = nearest(name, candidates)
    return f' (did you mean "{guess}"?)' if guess else ""


MISSPELLING_DISTANCE = 2
"""An unknown config key this close to a known key (edits: insert, delete, substitute, swap two neighbours) is
taken for a misspelling of it and refused; a key farther from every known key is someone else's (one warning)."""


def edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment): ``"enabeld"`` is 1 from ``"enabled"``."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]


def misspelling_of(name: str, known: Iterable[str], max_distance: int = MISSPELLING_DISTANCE) -> str | None:
    """The known key ``name`` most likely misspells (case ignored; nearest, then alphabetical), or None when every
    known key is more than ``max_distance`` edits away."""
    lowered = name.lower()
    scored = sorted((edit_distance(lowered, key.lower()), key) for key in set(known) if key != name)
    if scored and scored[0][0] <= max_distance:
        return scored[0][1]
    return None
