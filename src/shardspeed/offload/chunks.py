"""The streamed optimizer's unit of work: a ``Chunk`` (``sub_group_size`` elements of one stepped tensor), which
chunks ``offload_optimizer.ratio`` offloads, and small helpers over chunk lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Chunk:
    name: str  # store prefix of its three states
    tensor: torch.Tensor  # the stepped tensor it is a piece of
    start: int
    end: int
    offloaded: bool = True  # False: kept on the training device by offload_optimizer.ratio

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1)[self.start : self.end]


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """The (start, end) element ranges cutting a stepped tensor of ``numel`` elements into ``chunk_numel`` pieces."""
    return [(start, min(start + chunk_numel, numel)) for start in range(0, numel, chunk_numel)]


def offloaded_mask(sizes: Sequence[int], ratio: float) -> list[bool]:
    """Which chunks (in order) ``offload_optimizer.ratio`` offloads: chunk i does iff the elements before it are
    fewer than ``ratio`` × all elements (ratio 1: all, 0: none; whole chunks, so the split rounds up)."""
    total, before, mask = sum(sizes), 0, []
    for size in sizes:
        mask.append(before < ratio * total)
        before += size
    return mask


def by_tensor(chunks: list[Chunk]) -> list[tuple[torch.Tensor, list[Chunk]]]:
    """``chunks`` (tensor by tensor, in order) cut into runs of one stepped tensor each."""
    runs: list[tuple[torch.Tensor, list[Chunk]]] = []
    for chunk in chunks:
        if runs and runs[-1][0] is chunk.tensor:
            runs[-1][1].append(chunk)
        else:
            runs.append((chunk.tensor, [chunk]))
    return runs


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of a device tensor; CPU tensors are returned as they are (no copy)."""
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")
