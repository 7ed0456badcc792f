"""Activation bytes of one micro-batch, measured: the bytes of the tensors autograd saves for backward.

``SavedTensorCounter`` is a ``torch.autograd.graph.saved_tensors_hooks`` pair that only counts: each saved tensor's
storage is counted once (several ops save the same tensor), parameters are not activations and are left out, and
the tensor itself is returned unchanged (no copy, nothing changes what backward computes). Works on CPU and CUDA.

[Note: what the count misses] Saved tensors are what a forward keeps alive until backward; the peak of a step also
holds backward's transient gradients of activations and, with activation checkpointing, one block's recomputed
activations. With ``torch.utils.checkpoint`` (non-reentrant) the recomputed region saves through its own hooks, so
the count sees only what is saved outside checkpointed blocks — the checkpointed figure. The tuner corrects the
rest with a scale and offset fitted on the trials that ran (memory.py, ``fit_correction``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["SavedTensorCounter"]


class SavedTensorCounter:
    """Count the bytes autograd saves inside ``counting()`` (parameters excluded, each storage once)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {_storage_key(p) for p in params}
        self._seen: set[tuple[int, str]] = set()
        self.bytes = 0
        self.tensors = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._skip and key not in self._seen:
            self._seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
            self.tensors += 1
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @contextlib.contextmanager
    def counting(self) -> Iterator[SavedTensorCounter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def _storage_key(tensor: torch.Tensor) -> tuple[int, str]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), str(tensor.device)
