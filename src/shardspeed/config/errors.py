"""Config errors: one exception type, and the nearest-key suggestion every config error uses."""

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
