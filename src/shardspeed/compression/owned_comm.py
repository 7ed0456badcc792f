"""The two means an optimizer that owns communication needs: exact (fp32 all-reduce) and 1-bit compressed.

[Note: optimizer-owned means] ``ZeroOneAdam`` and ``OneBitLamb`` receive each rank's *local* gradients (the
engine does not all-reduce them while the optimizer owns communication) and decide per step what crosses the
wire: an exact mean of the gradients (0/1 Adam's variance steps), a compressed mean of gradients or of the
accumulated momentum (error-fed, one error-buffer pair per ``key``), or nothing (0/1 Adam's local steps). The
optimizer math is written against ``MeanComm`` so it runs unchanged on one process (``LocalComm``: every mean
is the identity, as on a data axis of size 1), on a process group (``CollectiveComm``, every byte through
``Collectives``) and in the tests' simulated workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from shardspeed.comm.collectives import Collectives
    from shardspeed.topology import AxisGroup


class MeanComm(Protocol):
    """Means over the data axis, in place. Every rank must make the same calls in the same order."""

    world: int

    def exact_mean(self, tensors: list[torch.Tensor]) -> None: ...

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None: ...

    def reset_errors(self) -> None: ...

    def errors_state_dict(self) -> dict[str, Any]: ...

    def load_errors_state_dict(self, sd: dict[str, Any]) -> None: ...


class LocalComm:
    """One process: every mean is the identity and there is no compression error (as on an axis of size 1)."""

    world = 1

    def exact_mean(self, tensors: list[torch.Tensor]) -> None:
        return None

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None:
        return None

    def reset_errors(self) -> None:
        return None

    def errors_state_dict(self) -> dict[str, Any]:
        return {}

    def load_errors_state_dict(self, sd: dict[str, Any]) -> None:
        return None


class CollectiveComm:
    """Means over ``axis`` through ``Collectives``: a flat fp32 all-reduce, or one ``CompressedAllReduce`` per key.

    The compressors are created on first use (the key's element count is known then) and keep their worker and
    server error buffers between steps; ``errors_state_dict`` is what a checkpoint at the same world size keeps.
    """

    def __init__(self, collectives: Collectives, axis: AxisGroup, tag: str) -> None:
        self.collectives = collectives
        self.axis = axis
        self.world = axis.size
        self.tag = tag
        self._compressors: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}  # loaded error state for compressors not built yet

    def exact_mean(self, tensors: list[torch.Tensor]) -> None:
        if self.world == 1 or not tensors:
            return
        # One flat fp32 all-reduce for the whole step, not one per tensor (fewer, larger messages).
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        self.collectives.all_reduce(flat, self.axis, tag=f"{self.tag}.exact").wait()
        flat.div_(self.world)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None:
        if self.world == 1:
            return
        compressor = self._compressors.get(key)
        if compressor is None:
            from shardspeed.compression.collective import CompressedAllReduce

            compressor = CompressedAllReduce(
                tensor.numel(), self.axis, self.collectives, device=tensor.device, tag=f"{self.tag}.{key}"
            )
            if key in self._pending:
                compressor.load_state_dict(self._pending.pop(key))
            self._compressors[key] = compressor
        flat = tensor.detach().reshape(-1).float().clone()
        compressor(flat)
        tensor.copy_(flat.view_as(tensor))

    def reset_errors(self) -> None:
        for compressor in self._compressors.values():
            compressor.reset()
        self._pending.clear()

    @property
    def error_bytes(self) -> int:
        return sum(c.error_bytes for c in self._compressors.values())

    def errors_state_dict(self) -> dict[str, Any]:
        return {key: c.state_dict() for key, c in self._compressors.items()} | dict(self._pending)

    def load_errors_state_dict(self, sd: dict[str, Any]) -> None:
        for key, state in sd.items():
            if key in self._compressors:
                self._compressors[key].load_state_dict(state)
            else:
                self._pending[key] = state


class OwnsCommunication:
    """What ZeroOneAdam and OneBitLamb add to ``torch.optim.Optimizer`` for the engine (the seam with the engine
    protocol): ``bind`` once before the first step, ``owns_communication`` (defined by each optimizer), and the
    checkpoint hooks for the error buffers (kept at the same world size, reset with a warning otherwise)."""

    comm: MeanComm

    def bind(self, collectives: Collectives, axis: AxisGroup) -> None:
        """Take the means over ``axis`` through ``collectives`` from now on."""
        self.comm = CollectiveComm(collectives, axis, tag=type(self).__name__)

    def bind_comm(self, comm: MeanComm) -> None:
        """Any ``MeanComm`` (the tests' simulated workers)."""
        self.comm = comm

    def compression_state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (each rank saves its own: they differ between ranks)."""
        return self.comm.errors_state_dict()

    def load_compression_state_dict(self, sd: dict[str, Any], same_world: bool) -> None:
        if same_world:
            self.comm.load_errors_state_dict(sd)
            return
        from shardspeed.log import logger

        logger.warning(
            f"{type(self).__name__}: the checkpoint's compression error buffers were saved at another data-parallel "
            "world size; they are reset (DeepSpeed always resets them)"
        )
        self.comm.reset_errors()
