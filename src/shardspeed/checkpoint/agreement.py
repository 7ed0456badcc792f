"""Ranks agree on the outcome of a checkpoint's local work (writing, committing, reading) before the next
collective, so a failure on one rank is the same clear error on every rank instead of a hang.

[Note: agreed checkpoint outcomes] Saving and loading alternate local file work with collectives: every rank
writes its pieces, then the records are all-gathered for the commit; every rank reads its ranges, then the stage
all-gathers the loaded values. A rank whose write hit ENOSPC, or whose read hit a damaged chunk, used to raise
while its peers went on into the collective and waited there forever. Now each phase of local work ends in one
all-gather of "what went wrong here" (``None`` when nothing did), and when any rank failed every rank raises an
error naming the first failing rank and its exception (and how many others failed). A failing rank raises the
same message as its peers, chained to its own exception. At load the type is kept where peers can rebuild it
(the checkpoint errors, ``ValueError``, ``TypeError``, ``KeyError``; anything else becomes a ``CheckpointError``),
so callers that catch a ``ValueError`` for a model mismatch still do; a failed save is a ``CheckpointWriteError``
(an ``OSError`` carrying the first failure's errno, e.g. ENOSPC). This is the save/load-local part of failure
propagation; an exception elsewhere in the engine is the failure-propagation module's concern.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardspeed.checkpoint.index import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointTilingError,
)
from shardspeed.faults.errors import mark_agreed


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed on some rank (a full disk, an I/O error): nothing was committed, ``latest`` is unchanged."""


# Types a peer rebuilds from their name and message; any other exception becomes a CheckpointError.
_REBUILDABLE: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointCorruptError,
        CheckpointNotFoundError,
        CheckpointTilingError,
        CheckpointKeyError,
        CheckpointWriteError,
        ValueError,
        TypeError,
        KeyError,
    )
}

Failure = tuple[str, str, int | None]
"""(exception type name, message, errno or None): what one rank reports; plain data for all_gather_object."""


def failure_of(error: BaseException) -> Failure:
    """The all-gatherable description of ``error``."""
    return type(error).__name__, str(error), getattr(error, "errno", None)


def agree_on_outcome(
    failure: Failure | None,
    gather: Callable[[Any], list[Any]],
    ranks: list[int],
    what: str,
    *,
    own_error: BaseException | None = None,
    write: bool = False,
    agreed: bool = True,
) -> None:
    """All-gather ``failure`` (None: this rank succeeded) and raise on every rank if any rank failed.

    ``gather`` all-gathers one object over the ranks taking part (``ranks`` are their global ranks, for messages);
    ``what`` says what they were doing ("save_checkpoint to /ckpt/global_step4"). ``write``: the error is a
    ``CheckpointWriteError`` (an ``OSError``, with the first failure's errno). ``own_error`` is chained.
    ``agreed``: the error leaves the engine usable (nothing changed); False when state was partly changed, so the
    failure guard fails the engine instead (faults/guard.py)."""
    everyone = gather(failure)
    failed = [(ranks[index], found) for index, found in enumerate(everyone) if found is not None]
    if not failed:
        return
    rank, (type_name, message, number) = failed[0]
    others = f" (and on {len(failed) - 1} more rank(s): {', '.join(str(r) for r, _ in failed[1:])})"
    text = f"{what} failed on rank {rank}: {type_name}: {message}{others if len(failed) > 1 else ''}"
    error: Exception
    if write:
        error = CheckpointWriteError(number, text) if number is not None else CheckpointWriteError(text)
    else:
        error = _REBUILDABLE.get(type_name, CheckpointError)(text)
    if agreed:
        mark_agreed(error)  # the same error on every rank, nothing changed: not a failure for the guard to publish
    if own_error is not None:
        raise error from own_error
    raise error
