"""The two means an optimizer that owns communication needs: exact (fp32 all-reduce) and 1-bit compressed.

[Note: optimizer-owned means] ``ZeroOneAdam`` and ``OneBitLamb`` receive each rank's *local* gradients (the
engine does not all-reduce them while the optimizer owns communication) and decide per step what crosses the
wire: an exact mean of the gradients (0/1 Adam's variance steps), a compressed mean of gradients or of the
accumulated momentum (error-fed, one error-buffer pair per ``key``; ``compressed_means`` compresses several
tensors each apart — its own padding, errors and scales, DeepSpeed's per-tensor granularity — in one set of
collectives), or nothing (0/1 Adam's local steps). The
optimizer math is written against ``MeanComm`` so it runs unchanged on one process (``LocalComm``: every mean
is the identity, as on a data axis of size 1), on the engine's data axis (``BoundComm``: the
``CompressedOptimizer`` base's compressors and collectives, so its error buffers are the ones checkpoints keep)
and in the tests' simulated workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardspeed.comm.collectives import Collectives
from shardspeed.compression.optim_base import CompressedOptimizer
from shardspeed.topology import AxisGroup


class MeanComm(Protocol):
    """Means over the data axis, in place. Every rank must make the same calls in the same order."""

    world: int

    def exact_mean(self, tensors: list[torch.Tensor]) -> None: ...

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None: ...

    def compressed_means(self, key: str, tensors: list[torch.Tensor]) -> None:
        """Each tensor's compressed mean, each compressed apart, as one call (the same tensors, in the same order,
        at every call with this ``key``)."""
        ...

    def reset_errors(self) -> None: ...


class LocalComm:
    """One process: every mean is the identity and there is no compression error (as on an axis of size 1)."""

    world = 1

    def exact_mean(self, tensors: list[torch.Tensor]) -> None:
        return None

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None:
        return None

    def compressed_means(self, key: str, tensors: list[torch.Tensor]) -> None:
        return None

    def reset_errors(self) -> None:
        return None


class BoundComm:
    """Means over ``axis``: one flat fp32 all-reduce for exact means, the base class's error-fed compressors
    (one per key, created on first use) for compressed ones: ``CompressedAllReduce`` for one tensor,
    ``PartwiseCompressedAllReduce`` for several ([Note: partwise compressed all-reduce])."""

    def __init__(
        self,
        collectives: Collectives,
        axis: AxisGroup,
        compressor: Callable[[str, int], Any],
        reset: Callable[[], None],
        tag: str,
        partwise: Callable[[str, list[int]], Any],
    ) -> None:
        self.collectives, self.axis, self.world = collectives, axis, axis.size
        self._compressor, self._reset, self.tag, self._partwise = compressor, reset, tag, partwise

    def exact_mean(self, tensors: list[torch.Tensor]) -> None:
        if self.world == 1 or not tensors:
            return
        # One flat fp32 all-reduce for the whole step, not one per tensor (fewer, larger messages).
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        self.collectives.all_reduce(flat, self.axis, tag=self.tag).wait()
        flat.div_(self.world)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None:
        if self.world == 1:
            return
        flat = tensor.detach().reshape(-1).float().clone()
        self._compressor(key, flat.numel())(flat)
        tensor.copy_(flat.view_as(tensor))

    def compressed_means(self, key: str, tensors: list[torch.Tensor]) -> None:
        if self.world == 1 or not tensors:
            return
        self._partwise(key, [t.numel() for t in tensors]).launch(tensors).wait()

    def reset_errors(self) -> None:
        self._reset()


class MeanCommOptimizer(CompressedOptimizer):
    """``CompressedOptimizer`` whose step talks to a ``MeanComm``: the engine's data axis once bound, one
    process before that, or whatever a test passes to ``bind_comm`` (simulated workers)."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._mean_comm: MeanComm | None = None

    def bind_comm(self, comm: MeanComm) -> None:
        """Any ``MeanComm`` instead of the engine's collectives (the tests' simulated workers)."""
        self._mean_comm = comm

    @property
    def comm(self) -> MeanComm:
        if self._mean_comm is not None:
            return self._mean_comm
        if not self.bound or self.axis.size == 1:
            return LocalComm()
        assert self._collectives is not None
        tag = f"{type(self).__name__}:exact"
        self._mean_comm = BoundComm(
            self._collectives, self.axis, self.compressor, self.reset_compression, tag, self.partwise_compressor
        )
        return self._mean_comm
