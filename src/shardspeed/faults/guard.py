"""The guard around every engine entry point: publish an exception, then refuse further calls.

An engine is HEALTHY until a call raises. Then, unless the error is agreed (raised identically on every rank:
``faults/errors.py``), it is FAILED: the exception is published on the failure board (every other rank raises
``PeerFailedError`` at its next wait or engine call) and every later call on this rank raises
``EngineFailedError`` naming the cause. Without that second half, a script that catches the exception and carries
on (the "skip the bad batch" pattern) would pair its collectives with the peers' next step's: silent corruption.
A peer's failure seen at entry (or raised from a wait inside the call) fails the engine as well.

Nested guarded calls (``save_fp16_model`` → ``save_16bit_model``, ``save_checkpoint`` → ``module_state_dict``)
act once, at the outermost call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from shardspeed.faults.board import FailureBoard
from shardspeed.faults.errors import EngineFailedError, PeerFailedError, describe, is_agreed

F = TypeVar("F", bound=Callable[..., Any])

GUARD_ATTR = "_fault_guard"


class EngineGuard:
    """HEALTHY → FAILED for one engine (or for ``initialize()`` while it builds one)."""

    def __init__(self, board: FailureBoard | None, rank: int, progress: Any = None) -> None:
        self.board = board
        self.rank = rank
        self._progress = progress  # the engine's counters (training/micro_driver.py's Progress), for messages
        self.cause: str | None = None  # set once: FAILED
        self._depth = 0

    @property
    def failed(self) -> bool:
        return self.cause is not None

    @contextlib.contextmanager
    def call(self, where: str) -> Iterator[None]:
        if self.board is None:  # propagation off or a world of one: nothing to tell anyone
            yield
            return
        if self._depth == 0:
            self._check_usable(where)
        self._depth += 1
        try:
            yield
        except BaseException as exc:
            if self._depth == 1:
                self._on_error(where, exc)
            raise
        finally:
            self._depth -= 1

    def _check_usable(self, where: str) -> None:
        if self.cause is not None:
            raise EngineFailedError(self.cause)
        assert self.board is not None
        failure = self.board.failure
        if failure is not None:
            self.cause = failure.summary()
            raise PeerFailedError(failure, f"entering {where}")

    def _on_error(self, where: str, exc: BaseException) -> None:
        if isinstance(exc, EngineFailedError) or is_agreed(exc):
            return
        if isinstance(exc, PeerFailedError):
            self.cause = exc.failure.summary()
            return
        progress = self._progress
        place = (
            f"{where} at step {progress.global_steps} (micro-step {progress.micro_steps})"
            if progress is not None
            else where
        )
        self.cause = f"rank {self.rank} raised in {place}: {describe(exc, limit=300)}"
        assert self.board is not None
        self.board.publish(place, exc)


def guarded(where: str) -> Callable[[F], F]:
    """Method decorator: run the call under the instance's ``EngineGuard`` (if it has one yet: during
    construction it has not, and ``initialize()`` guards construction itself)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            guard = self.__dict__.get(GUARD_ATTR)  # __dict__: nn.Module's __getattr__ would ask the model
            if guard is None:
                return fn(self, *args, **kwargs)
            with guard.call(where):
                return fn(self, *args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
