"""``RepeatingLoader``: DeepSpeed's name for "iterate a loader forever", for step-counted training loops."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Yields from ``loader`` endlessly, starting a new pass each time one is exhausted.

    With a :class:`~shardspeed.data.ShardSpeedDataLoader` each new pass is the next epoch (its own order);
    any other iterable is simply iterated again. ``len()``, ``state_dict()`` and ``load_state_dict()`` are
    those of the wrapped loader, so a loop written around the wrapper can still checkpoint its position.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            pass
        # A fresh pass that yields nothing would otherwise spin here forever.
        self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            raise RuntimeError(
                f"RepeatingLoader: the wrapped {type(self.loader).__name__} yielded no batch in a whole pass"
            ) from None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]
        self._iterator = None  # the next item comes from the restored position
