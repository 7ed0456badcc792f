"""Ranks agree on the outcome of a streamed optimizer step over NVMe, so a swap write that fails on one rank (a
full disk mid-run) is the same clear error on every rank instead of a hang in the stage's next all-gather.

[Note: agreed offload step] The step is local work (read states from the swap file, Adam, write them back)
followed by the stage's collective (``after_optimizer_step`` all-gathers the updated shards). An ``OSError`` from a
swap write surfaced only on the rank whose disk was full, and its peers waited in the all-gather. Now, with an
NVMe store, every step ends in one all-gather of this rank's failure (None when none): a small object, negligible
next to a step that streams the optimizer states through a disk. On failure every rank raises ``SwapIOError``
naming the first failing data-parallel rank, its exception (the swapper names the swap file, tensor and byte
offset) and the step; the failing rank chains its own exception.
"""

from __future__ import annotations

from collections.abc import Callable


class SwapIOError(OSError):
    """An NVMe swap read or write failed during an optimizer step on some data-parallel rank."""


def run_agreed(step: Callable[[], None], agree: Callable[[object], list[object]], what: str) -> None:
    """Run ``step`` and all-gather its outcome (``agree``: the data-parallel all-gather); raise on every rank if
    any rank's step raised. ``what`` names the step in messages ("offload_optimizer step 3")."""
    failure: tuple[str, str, int | None] | None = None
    own: BaseException | None = None
    try:
        step()
    except Exception as error:  # any local failure: the peers must not wait for this rank in the next collective
        failure, own = (type(error).__name__, str(error), getattr(error, "errno", None)), error
    failed = [(rank, found) for rank, found in enumerate(agree(failure)) if found is not None]
    if not failed:
        return
    rank, (type_name, message, number) = failed[0]  # type: ignore[misc]
    more = f" (and on data-parallel ranks {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
    text = f"{what} failed on data-parallel rank {rank}: {type_name}: {message}{more}"
    error = SwapIOError(number, text) if number is not None else SwapIOError(text)
    raise error from own
