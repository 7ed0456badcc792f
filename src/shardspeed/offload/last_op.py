"""``TensorSwapper`` bookkeeping: the latest operation per swap name is remembered only while it can matter.

The swapper orders same-name operations by making each wait for the previous one, so it remembers the latest
per name; and ``flush`` re-raises failures. A finished, successful operation matters to neither, while its
handle holds the tensor it read or wrote: remembering it would keep every swapped-out tensor in memory.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .swapper import SwapHandle


class ForgetWhenDone:
    """Future callback: once every piece of an operation succeeded, drop it from ``last_op`` (unless a newer
    operation on the name replaced it). Holds a weak reference to the handle: futures keep their callbacks, and a
    strong one would make a cycle that frees the tensor only when the garbage collector runs."""

    def __init__(
        self,
        last_op: dict[str, SwapHandle],
        lock: threading.Lock,
        name: str,
        handle: weakref.ref[SwapHandle],
        pieces: int,
    ) -> None:
        self._last_op, self._lock, self._name, self._handle = last_op, lock, name, handle
        self._remaining, self._failed = pieces, False

    def __call__(self, future: Future[None]) -> None:
        with self._lock:
            self._remaining -= 1
            self._failed = self._failed or future.cancelled() or future.exception() is not None
            current = self._last_op.get(self._name)
            if self._remaining == 0 and not self._failed and current is not None and current is self._handle():
                del self._last_op[self._name]
