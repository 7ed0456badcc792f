"""``StreamedAdam.state``: the optimizer state as the checkpoint code reads it, swapped in on demand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .optimizer import StreamedAdam


class SwappedState:
    """``optimizer.state`` for the checkpoint code: reading a tensor's entry swaps its moments in.

    ``get`` (saving) keeps one tensor's state in memory at a time; ``[tensor]`` (loading) keeps every entry it
    hands out until ``StreamedAdam.after_checkpoint_load`` writes them back to the store.
    """

    def __init__(self, owner: StreamedAdam) -> None:
        self._owner = owner
        self._last: tuple[int, dict[str, Any]] | None = None
        self.loading: dict[int, dict[str, Any]] = {}

    def get(self, tensor: torch.Tensor, default: Any = None) -> Any:
        key = id(tensor)
        if key in self.loading:
            return self.loading[key]
        if key not in self._owner.chunks_of:
            return default
        if self._last is None or self._last[0] != key:
            self._last = (key, self._owner.read_state(tensor))
        return self._last[1]

    def __getitem__(self, tensor: torch.Tensor) -> dict[str, Any]:
        key = id(tensor)
        if key not in self._owner.chunks_of:
            raise KeyError("not a tensor this optimizer steps")
        if key not in self.loading:
            self.loading[key] = self._owner.read_state(tensor)
        return self.loading[key]

    def __contains__(self, tensor: object) -> bool:
        return id(tensor) in self._owner.chunks_of

    def __len__(self) -> int:
        return len(self._owner.chunks_of)

    def values(self) -> list[dict[str, Any]]:
        """Only the entries currently in memory (the rest are in the store, not host memory)."""
        return list(self.loading.values())

    def __iter__(self) -> Iterator[int]:
        return iter(self.loading)

    def forget(self) -> None:
        self._last = None
        self.loading.clear()
