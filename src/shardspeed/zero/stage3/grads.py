"""ZeRO-3 gradients of one unit: staged whole only while its backward finishes, then reduce-scattered.

Each parameter's gradient is folded into the unit's staging buffer (wire dtype, padded) as it arrives and the
parameter's own ``.grad`` is dropped; when every trainable parameter of the unit has arrived, the buffer is
reduce-scattered (asynchronously) and this rank's slice is added into the fp32 gradient shard. The staging
buffer is freed as soon as the collective finishes. Like gathers, every reduce-scatter carries the unit-id check
(see [Note: unit-id check] in unit.py).
"""

from __future__ import annotations

import torch

from shardspeed.comm import Work
from shardspeed.offload.aligned import aligned_empty
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.stage3.unit import ParamUnit

_MAPPED_MIN_NUMEL = 1 << 18  # 1 MiB of fp32


class UnitGrads:
    def __init__(self, unit: ParamUnit, ctx: CommContext) -> None:
        self.unit, self.ctx = unit, ctx
        self.trainable = {i for i, p in enumerate(unit.params) if p.requires_grad}
        self.grad_shard = _zeros(unit.shard_numel if self.trainable else 0, unit.device)
        self.arrived: set[int] = set()
        self.launched = False
        self._staging: torch.Tensor | None = None
        self._pending: tuple[Work, Work, torch.Tensor, torch.Tensor] | None = None
        self._pending_input: torch.Tensor | None = None  # the staged input must outlive the async collective

    @property
    def complete(self) -> bool:
        return bool(self.trainable) and self.arrived >= self.trainable

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.zeros(self.unit.padded_numel, dtype=self.ctx.comm_dtype, device=self.unit.device)
        return self._staging

    def absorb(self, local_index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        off, n = self.unit.offsets[local_index], self.unit.numels[local_index]
        self._staging_buffer()[off : off + n].add_(grad.reshape(-1))
        param.grad = None
        self.arrived.add(local_index)

    def launch(self) -> None:
        """Reduce-scatter the staged gradients (zeros for parameters that got none this backward)."""
        assert not self.launched, f"gradients of unit '{self.unit.name}' reduced twice in one backward"
        self.launched = True
        if not self.trainable:
            return
        staged = self._staging_buffer()
        self._staging = None
        if self.ctx.scaling.pre != 1.0:
            staged.mul_(self.ctx.scaling.pre)
        axis = self.ctx.axis
        ids = torch.empty(axis.size, dtype=torch.int64, device=staged.device)
        mine = torch.full((1,), self.unit.index, dtype=torch.int64, device=staged.device)
        id_work = self.ctx.collectives.all_gather(ids, mine, axis, async_op=True, tag="unit_ids")
        out = torch.empty(self.unit.shard_numel, dtype=staged.dtype, device=staged.device)
        work = self.ctx.collectives.reduce_scatter(out, staged, axis, async_op=True, tag="grads")
        self._pending = (id_work, work, ids, out)
        self._pending_input = staged

    def finish(self) -> bool:
        """Wait for the launched reduce-scatter and add it into the shard; False if none was pending."""
        if self._pending is None:
            return False
        id_work, work, ids, out = self._pending
        id_work.wait()
        self.unit.check_same_unit(ids, "gradient reduce-scatter")
        work.wait()
        if self.ctx.scaling.post != 1.0:
            out.mul_(self.ctx.scaling.post)
        self.grad_shard.add_(out)
        self._pending = None
        self._pending_input = None
        return True

    def reset_backward(self) -> None:
        self.arrived.clear()
        self.launched = False

    def zero(self) -> None:
        self.grad_shard.zero_()
        self._staging = None


def _zeros(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 zeros. On the CPU from a fresh anonymous mapping, whose pages the kernel zero-fills on first touch:
    a gradient shard costs no resident memory until a backward writes it, so building the model (which holds
    every parameter shard for a moment when parameters are offloaded) does not also hold every gradient shard.
    Small shards use the allocator: a mapping each would cost a page and count against the kernel's map limit."""
    if device.type != "cpu" or numel < _MAPPED_MIN_NUMEL:
        return torch.zeros(numel, dtype=torch.float32, device=device)
    return aligned_empty(numel, torch.float32)
