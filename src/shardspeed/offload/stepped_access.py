"""How the streamed optimizer reaches its stepped tensors' values (``SteppedAccess``), and the ``on_chunk_done``
that writes updated chunks through it.

Most stages' stepped tensors hold their values (``DirectAccess``). Others step storage-less stand-ins
(``stand_in``) whose values are elsewhere: ZeRO-3 fp32 with ``offload_param`` in the owning unit's offloaded shard
(zero/stage3/param_offload.py ``ShardSlices``: ``open`` reads the shard in, ``close`` writes it back and frees
it); mixed precision whose fp32 masters the streamed optimizer holds in the low-precision parameters
(``TargetSlices`` for ZeRO-1/2, ``ShardSlices`` for ZeRO-3), which the optimizer writes with a cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class ChunkOfTensor(Protocol):
    """What the writer needs of a chunk: its stepped tensor and its element range there."""

    tensor: torch.Tensor
    start: int
    end: int


class SteppedAccess(Protocol):
    """Where a stepped tensor's values are: ``open`` returns them as a 1-D tensor (``writing``: the caller will
    change them), ``close`` ends that use. Calls come in pairs, one tensor open at a time."""

    def open(self, tensor: torch.Tensor, writing: bool) -> torch.Tensor: ...

    def close(self, tensor: torch.Tensor) -> None: ...


class DirectAccess:
    """Stepped tensors that hold their own values (every stage, except ZeRO-3 fp32 with offload_param)."""

    def open(self, tensor: torch.Tensor, writing: bool) -> torch.Tensor:
        return tensor.view(-1)

    def close(self, tensor: torch.Tensor) -> None:
        return None


class TargetSlices:
    """``SteppedAccess`` for stand-ins whose values are another tensor (ZeRO-1/2 mixed precision whose fp32
    masters the streamed optimizer holds: the stand-in's values are its low-precision parameter slice)."""

    def __init__(self) -> None:
        self._target: dict[int, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor, target: torch.Tensor) -> None:
        self._target[id(tensor)] = target.view(-1)

    def open(self, tensor: torch.Tensor, writing: bool) -> torch.Tensor:
        return self._target.get(id(tensor), tensor.view(-1))

    def close(self, tensor: torch.Tensor) -> None:
        return None


def stand_in(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A storage-less 1-D tensor of ``numel`` elements of ``like``'s dtype and device (one element, stride 0): an
    optimizer key and ``.grad`` holder whose values live elsewhere. Writing to it raises, so a missed
    ``SteppedAccess.open`` fails loudly instead of updating nothing."""
    return torch.zeros(1, dtype=like.dtype, device=like.device).expand(numel)


class ChunkWriter:
    """``on_chunk_done`` for ``stream_step``: copies updated chunks into their stepped tensors, opening each
    tensor just before its first chunk and closing it right after its last (chunks come tensor by tensor)."""

    def __init__(self, access: SteppedAccess, chunks: Sequence[ChunkOfTensor]) -> None:
        self._access, self._chunks = access, chunks
        self._open: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def write(self, index: int, updated: torch.Tensor) -> None:
        chunk = self._chunks[index]
        if self._open is not chunk.tensor:
            self.finish()
            self._values = self._access.open(chunk.tensor, writing=True)
            self._open = chunk.tensor
        assert self._values is not None
        self._values[chunk.start : chunk.end].copy_(updated)  # blocking: the stream reuses ``updated``

    def finish(self) -> None:
        if self._open is not None:
            opened, self._open, self._values = self._open, None, None
            self._access.close(opened)
