"""ZeRO-3 gradients of one unit: held as they arrive, reduce-scattered in bucket-sized pieces once all are in.

Each parameter's gradient is taken off the parameter as it arrives (``absorb``: the parameter's ``.grad`` is
dropped, the tensor kept here). When every trainable parameter of the unit has arrived, ``launch`` reduce-
scatters the unit in pieces ([Note: bucketed reduce-scatter]) and this rank's slice of each piece is added into
the fp32 gradient shard. Like gathers, a unit's reduce-scatter carries the unit-id check ([Note: unit-id check]
in id_check.py).

[Note: bucketed reduce-scatter] ``reduce_bucket_size`` bounds what is staged in the wire dtype, as in stages
0-2. A piece covers shard elements [lo, hi) of every rank (hi - lo ≤ reduce_bucket_size / N), so its input is
the N slices [r·S + lo, r·S + hi) of the unit's padded flat gradient copied next to each other — at most
reduce_bucket_size elements — and its output is exactly this rank's [lo, hi). All pieces share one
``StagingBudget``: before a piece is staged, the oldest launched pieces (of any unit) are completed until the
live staging fits in reduce_bucket_size × the wire dtype's size (or one piece, when a bucket is smaller than
N elements). ``StagingBudget.peak_bytes`` is the figure tests read.

With gradients on NVMe (``offload_to``: [Note: gradients on NVMe] in grad_offload.py) ``grad_shard`` is empty
between backward passes: allocated at ``launch`` (the previous micro-step's sum read back into it), written behind
and dropped at ``finish``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardspeed.comm import Work
from shardspeed.offload.aligned import aligned_empty
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.stage3.unit import ParamUnit

if TYPE_CHECKING:
    from shardspeed.offload.stream import Handle
    from shardspeed.zero.stage3.grad_offload import UnitGradSink

_MAPPED_MIN_NUMEL = 1 << 18  # 1 MiB of fp32


class PlaceholderGradientError(RuntimeError):
    """A ZeRO-3 parameter was used while it was an empty placeholder (outside its module's forward)."""


@dataclass
class _Piece:
    owner: UnitGrads
    lo: int  # shard range this piece reduces
    hi: int
    staging: torch.Tensor  # the input: must outlive the asynchronous collective
    out: torch.Tensor
    work: Work


class StagingBudget:
    """Live wire-dtype staging of every unit's launched reduce-scatter pieces, bounded by ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._launched: deque[_Piece] = deque()

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` of staging by completing the oldest launched pieces."""
        while self._launched and self.live_bytes + nbytes > self.limit_bytes:
            self._complete(self._launched.popleft())
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def add(self, piece: _Piece) -> None:
        self._launched.append(piece)

    def complete_all_of(self, owner: UnitGrads) -> None:
        mine = [p for p in self._launched if p.owner is owner]
        if mine:
            self._launched = deque(p for p in self._launched if p.owner is not owner)
        for piece in mine:
            self._complete(piece)

    def _complete(self, piece: _Piece) -> None:
        piece.work.wait()
        self.live_bytes -= piece.staging.numel() * piece.staging.element_size()
        piece.owner.add_reduced(piece.lo, piece.hi, piece.out)


class UnitGrads:
    def __init__(
        self,
        unit: ParamUnit,
        ctx: CommContext,
        budget: StagingBudget,
        bucket_numel: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``dtype``: the gradient shard's (the master dtype: fp32, or bf16 with bf16 master weights)."""
        self.unit, self.ctx, self.budget = unit, ctx, budget
        self.dtype = dtype
        # [Note: step-scoped hold] in zero/hold.py: the unit's gradients of backward passes that did not
        # communicate, accumulated in the master dtype over the unit's padded flat layout (allocated at the first
        # held gradient, freed once ``launch_held`` staged it)
        self.step_held: torch.Tensor | None = None
        self.trainable = {i for i, p in enumerate(unit.params) if p.requires_grad}
        self.grad_shard = _zeros(unit.shard_numel if self.trainable else 0, unit.device, dtype)
        self.arrived: set[int] = set()
        self.launched = False
        self._held: dict[int, torch.Tensor] = {}  # local parameter index → its gradient this backward
        self._awaiting = False  # launched pieces not yet finished
        width = max(1, bucket_numel // ctx.axis.size)
        self.pieces = [(lo, min(lo + width, unit.shard_numel)) for lo in range(0, unit.shard_numel, width)]
        self.sink: UnitGradSink | None = None  # offload_to: the shard lives in the swap file between backward passes
        self._reading: list[Handle] = []  # the previous micro-step's sum being read back into grad_shard

    def offload_to(self, sink: UnitGradSink) -> None:
        """[Note: gradients on NVMe]: from now on the shard is in memory only while this unit is being reduced."""
        self.sink = sink
        self.grad_shard = torch.empty(0, dtype=self.dtype, device=self.unit.device)

    @property
    def complete(self) -> bool:
        return len(self.trainable) > 0 and self.arrived >= self.trainable

    def absorb(self, local_index: int, param: torch.nn.Parameter) -> None:
        grad = self._take(local_index, param)
        if grad is None:
            return
        held = self._held.get(local_index)
        self._held[local_index] = grad if held is None else held + grad
        self.arrived.add(local_index)

    def hold(self, local_index: int, param: torch.nn.Parameter) -> None:
        """A backward that does not communicate: add the gradient into the step's held buffer (master dtype)."""
        grad = self._take(local_index, param)
        if grad is None:
            return
        self.held_view(local_index).add_(grad.reshape(self.unit.shapes[local_index]))
        self.arrived.add(local_index)

    def held_view(self, local_index: int) -> torch.Tensor:
        """Parameter ``local_index``'s part of the step's held gradient, shaped like it (allocated on first use)."""
        if self.step_held is None:
            self.step_held = torch.zeros(self.unit.padded_numel, dtype=self.dtype, device=self.unit.device)
        off, n = self.unit.offsets[local_index], self.unit.numels[local_index]
        return self.step_held[off : off + n].view(self.unit.shapes[local_index])

    def launch_held(self) -> None:
        """Reduce-scatter what the step held (zeros if nothing: unused), as a final backward's launch would."""
        self.reset_backward()
        self.launch()

    def _join_held(self) -> None:
        """This backward's gradients (if any) join what earlier backward passes held; the held buffer is reduced."""
        assert self.step_held is not None
        for i, grad in self._held.items():
            self.held_view(i).add_(grad.reshape(self.unit.shapes[i]))
        flat, offsets, numels = self.step_held, self.unit.offsets, self.unit.numels
        self._held = {i: flat[offsets[i] : offsets[i] + numels[i]] for i in sorted(self.trainable)}

    def _take(self, local_index: int, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The fresh gradient off the parameter (checked against the full shape), or None."""
        grad = param.grad
        if grad is None:
            return None
        if grad.numel() != self.unit.numels[local_index]:
            name = self.unit.names[local_index]
            raise PlaceholderGradientError(
                f"ZeRO-3 parameter '{name}' got a gradient of {grad.numel()} elements for its "
                f"{tuple(self.unit.shapes[local_index])} values: it was read outside its module's forward (e.g. a "
                "penalty over model.parameters() after forward), where ZeRO-3 parameters are empty placeholders. "
                "Compute such terms inside the module's forward, or run them and the backward inside "
                "shardspeed.zero.GatheredParameters(params)."
            )
        param.grad = None  # this unit keeps the gradient until its reduce-scatter is staged
        return grad

    def launch(self) -> None:
        """Reduce-scatter the held gradients piece by piece (zeros for parameters that got none)."""
        assert not self.launched, f"gradients of unit '{self.unit.name}' reduced twice in one backward"
        self.launched = True
        if not self.trainable:
            return
        self.unit.id_check.launch(self.unit.index, "gradient reduce-scatter", self.unit.device)
        if self.step_held is not None:
            self._join_held()
        if self.sink is not None:
            self._open_offloaded_shard(self.sink)
        for lo, hi in self.pieces:
            self._launch_piece(lo, hi)
        self._held.clear()
        self.step_held = None  # every piece is staged: the held buffer is free
        self._awaiting = True

    def _launch_piece(self, lo: int, hi: int) -> None:
        unit, world, width = self.unit, self.ctx.axis.size, hi - lo
        dtype = self.ctx.comm_dtype
        self.budget.reserve(world * width * dtype.itemsize)
        staging = torch.zeros(world * width, dtype=dtype, device=unit.device)
        for r in range(world):  # rank r's slice of the unit: [r·S + lo, r·S + hi) of the padded flat gradient
            seg_lo, seg_hi = r * unit.shard_numel + lo, r * unit.shard_numel + hi
            for i, grad in self._held.items():
                off = unit.offsets[i]
                a, b = max(seg_lo, off), min(seg_hi, off + unit.numels[i])
                if a < b:
                    dst = r * width + a - seg_lo
                    staging[dst : dst + b - a].copy_(grad.reshape(-1)[a - off : b - off])
        if self.ctx.scaling.pre != 1.0:
            staging.mul_(self.ctx.scaling.pre)
        out = torch.empty(width, dtype=dtype, device=unit.device)
        # The staging copy is dropped once reduced: an all-reduce-then-slice may run in it (no second copy).
        work = self.ctx.collectives.reduce_scatter(
            out, staging, self.ctx.axis, async_op=True, tag="grads", clobber_input=True
        )
        self.budget.add(_Piece(self, lo, hi, staging, out, work))

    def _open_offloaded_shard(self, sink: UnitGradSink) -> None:
        """A fresh shard for this reduction, with what earlier micro-steps of the step accumulated read back into
        it (asynchronously: the first reduced piece waits for it)."""
        self.grad_shard = _zeros(self.unit.shard_numel, self.unit.device, self.dtype)
        sink.allocated(self.grad_shard.numel() * self.grad_shard.element_size())
        if sink.has(self.unit.index):
            self._reading = sink.read_back(self.unit.index, self.grad_shard)

    def add_reduced(self, lo: int, hi: int, out: torch.Tensor) -> None:
        if self.ctx.scaling.post != 1.0:
            out.mul_(self.ctx.scaling.post)
        if self._reading:
            assert self.sink is not None
            self.sink.swap.wait_deferred(self._reading)  # [Note: deferred gradient I/O failures]
            self._reading = []
        self.grad_shard[lo:hi].add_(out)

    def finish(self) -> bool:
        """Wait for this unit's launched pieces and add them into the shard; False if none was pending."""
        if not self._awaiting:
            return False
        self.budget.complete_all_of(self)
        self._awaiting = False
        self.unit.id_check.after_wait()
        if self.sink is not None:  # written behind; the shard's memory goes once the write is done
            if self._reading:
                self.sink.swap.wait_deferred(self._reading)
                self._reading = []
            self.sink.write(self.unit.index, self.grad_shard)
            self.grad_shard = torch.empty(0, dtype=self.dtype, device=self.unit.device)
        return True

    def reset_backward(self) -> None:
        self.arrived.clear()
        self.launched = False
        self._held.clear()  # an aborted backward's gradients never reach the next one

    def zero(self) -> None:
        if self.sink is not None:
            self.sink.forget(self.unit.index)
        else:
            self.grad_shard.zero_()
        self._held.clear()
        self.step_held = None

    def forget(self, local_index: int) -> None:
        """Drop parameter ``local_index``'s gradient: its piece of this rank's reduced shard (user code cleared
        its ``.grad`` between backward passes)."""
        self._held.pop(local_index, None)
        if self.step_held is not None:
            self.held_view(local_index).zero_()
        off, n, lo = self.unit.offsets[local_index], self.unit.numels[local_index], self.unit.rank_start
        a, b = max(off, lo), min(off + n, lo + self.unit.shard_numel)
        if a < b and self.sink is not None:
            self.sink.forget_range(self.unit.index, a - lo, b - lo)
        elif a < b and self.grad_shard.numel():
            self.grad_shard[a - lo : b - lo].zero_()


def _zeros(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros of ``dtype``. On the CPU from a fresh anonymous mapping, whose pages the kernel zero-fills on first touch:
    a gradient shard costs no resident memory until a backward writes it, so building the model (which holds
    every parameter shard for a moment when parameters are offloaded) does not also hold every gradient shard.
    Small shards use the allocator: a mapping each would cost a page and count against the kernel's map limit."""
    if device.type != "cpu" or numel < _MAPPED_MIN_NUMEL:
        return torch.zeros(numel, dtype=dtype, device=device)
    return aligned_empty(numel, dtype)
