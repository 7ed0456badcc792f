"""The errors failure propagation raises, and the record a failing rank publishes.

``PeerFailedError`` is what every other rank sees: "rank 1 failed in engine.step(): RuntimeError: …" plus what this
rank was doing. ``PeerDiedError`` is its kill -9 form (the peer process is gone; nothing was published by it).
``EngineFailedError`` is raised by any call on an engine that already raised: the "skip the bad batch" pattern
(catch the exception, carry on) would otherwise pair collectives off by one step ([Note: failure propagation] in
``faults/board.py``).

Errors that every rank raises identically — a config error, a check agreed across ranks first — are *agreed*: the
guard neither publishes them nor fails the engine, so a script may catch them and carry on (``mark_agreed``).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass

DIED = "process died"  # FailureRecord.where of a peer that vanished (published by the rank that noticed)
_AGREED_ATTR = "_shardspeed_agreed"
_PUBLISHED_ATTR = "_shardspeed_published"


@dataclass(frozen=True)
class FailureRecord:
    """One origin failure, as published on the board (JSON in the store) and written to ``SHARDSPEED_FAILURE_DIR``."""

    rank: int
    where: str  # "engine.step() at step 3", "user code (uncaught)", "process died"
    error: str  # "RuntimeError: message"
    time: float  # time.time() on the failing (or, for a death, the detecting) rank

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> FailureRecord:
        data = json.loads(text)
        return FailureRecord(int(data["rank"]), str(data["where"]), str(data["error"]), float(data["time"]))

    @staticmethod
    def of(rank: int, where: str, exc: BaseException) -> FailureRecord:
        return FailureRecord(rank, where, describe(exc), time.time())

    def summary(self) -> str:
        if self.where == DIED:
            return f"rank {self.rank} died: {self.error}"
        if self.rank < 0:
            return f"a collective failed: {self.error}"
        return f"rank {self.rank} failed in {self.where}: {self.error}"


def describe(exc: BaseException, limit: int = 2000) -> str:
    """``"Type: message"``, the message cut at ``limit`` characters (a store value, one log line)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


class PeerFailedError(RuntimeError):
    """Another rank failed; this rank stopped instead of waiting for it in a collective."""

    def __init__(self, failure: FailureRecord, doing: str) -> None:
        self.failure = failure
        self.doing = doing
        super().__init__(f"{failure.summary()} (this rank was {doing})")


class PeerDiedError(PeerFailedError):
    """A peer process vanished (killed, crashed in C++) while this rank communicated with it."""


class EngineFailedError(Exception):
    """A call on an engine that already raised on this rank (or saw a peer fail): its collectives would no longer
    pair with the other ranks', so every further call refuses. Not a RuntimeError on purpose: the "skip the bad
    batch" loop usually catches RuntimeError (CUDA OOM, a bad sample), and must not swallow this one."""

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(f"this engine is unusable: {cause}. Fix the cause and restart (or resume from a checkpoint)")


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised identically on every rank (checked symmetrically first): not a failure to propagate,
    and the engine stays usable. Returns ``exc`` so call sites can ``raise mark_agreed(ValueError(...))``."""
    setattr(exc, _AGREED_ATTR, True)
    return exc


def is_agreed(exc: BaseException) -> bool:
    from shardspeed.config.errors import ConfigError  # parsed the same from the same config on every rank
    from shardspeed.optim.absent import NoOptimizerError  # decided by the config and initialize()'s arguments

    return bool(getattr(exc, _AGREED_ATTR, False)) or isinstance(exc, (ConfigError, NoOptimizerError))


def mark_published(exc: BaseException) -> None:
    """The guard published ``exc`` already: the excepthook must not publish it a second time."""
    # an exception type with __slots__ refuses: publishing twice is harmless (the first failure wins)
    with contextlib.suppress(AttributeError):
        setattr(exc, _PUBLISHED_ATTR, True)


def is_published(exc: BaseException) -> bool:
    return bool(getattr(exc, _PUBLISHED_ATTR, False))
