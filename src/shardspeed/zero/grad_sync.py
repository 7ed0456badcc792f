"""How each ZeRO stage holds and communicates gradients, one bucket at a time (driven by zero/reducer.py).

  stage 0  AllReduceGrads        full fp32 buffer; all-reduce each bucket in place on the boundary
  stage 1  ReduceScatterGrads    full fp32 buffer accumulates micro-steps; on the boundary each bucket is
                                 reduce-scattered straight into this rank's fp32 gradient shard
  stage 2  StagedReduceScatter   no full buffer: a bucket's gradients are staged only until the bucket is
                                 complete, reduce-scattered every micro-step, added into the fp32 shard, and the
                                 staging memory is released at once
A backward that does not communicate (a pipeline step's hold: [Note: step-scoped hold] in zero/hold.py) ``hold``s
its gradients: stages 0/1 in their full buffer, stage 2 in per-bucket held buffers in the master dtype, reduce-
scattered (and freed) when the held reduction launches each bucket.
Averaging over the data axis is ``pre`` before the sum and ``post`` after it (GradScaling).

[Note: staging memory] "Staging" is a full-bucket copy of gradients that exists only to be communicated: stage 2's
bucket buffers, and at stages 0/1 the wire-dtype copy of a bucket when ``communication_data_type`` differs from
fp32 (in fp32 they reduce the persistent buffer in place: no staging). Every GradSync counts what it stages in one
``StagingMeter`` (live bytes and the peak). The reducer bounds it: at most ``REDUCTIONS_IN_FLIGHT`` buckets in
flight plus the one filling, as long as gradients arrive in bucket order — which the arrival-order layout
(zero/arrival_order.py) makes true from the first backward on. Reduce-scatter outputs (1/N of an in-flight bucket
each) are not counted.

[Note: clobbered inputs] Stages 1 and 2 let the reduce-scatter overwrite its input (``clobber_input=True``), so
an all-reduce-then-slice ([Note: collective algorithms] in comm/algorithms.py) runs in place with no scratch
bucket. Every input is dead once reduced: a wire-dtype copy (``communication_data_type``) is dropped at
``complete``; stage 2's staging buffer and its held buckets ([Note: step-scoped hold]) are freed at ``complete``;
stage 1 in fp32 reduces its full buffer in place — this rank's slice is then overwritten by the reduced result,
and the other ranks' slices (stale local gradients before, partial sums now) are read by nothing: the optimizer
and the norm see only this rank's slices, ``reopen`` zeroes the rest, and the step zeroes the whole buffer.
Visible to users: there, a parameter's ``.grad`` is a view of that buffer ([Note: gradient markers]), so between
the boundary backward and ``step()`` a ``p.grad`` read outside this rank's slices shows those sums (native: this
rank's unreduced gradient) — never the reduced mean, under either algorithm (DeepSpeed's ZeRO does not keep it
in ``p.grad`` either: its scripts read the accessors). ``safe_get_full_grad`` / ``safe_get_local_grad`` read only owned,
reduced slices (tests/dist/test_safe_access.py runs them under the all-reduce algorithm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.comm.composite import in_slot
from shardspeed.topology import AxisGroup
from shardspeed.zero.grad_buffer import FlatGradBuffer
from shardspeed.zero.layout import ShardLayout

if TYPE_CHECKING:
    from shardspeed.zero.compressed_grads import GradCompression


@dataclass(frozen=True)
class GradScaling:
    """Gradient averaging over the data axis: multiply by ``pre`` before the sum and ``post`` after.

    Default (DeepSpeed's postscale): pre = 1/predivide_factor, post = predivide_factor/N. With
    ``prescale_gradients``: pre = 1/N, post = 1 (risks fp16 underflow, which is why it is not the default).
    """

    pre: float
    post: float

    @classmethod
    def for_config(cls, world: int, prescale: bool, predivide_factor: float) -> GradScaling:
        if prescale:
            return cls(1.0 / world, 1.0)
        return cls(1.0 / predivide_factor, predivide_factor / world)


@dataclass
class StagingMeter:
    """Staging bytes alive now and the most ever alive at once (see [Note: staging memory])."""

    live: int = 0
    peak: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)

    def release(self, t: torch.Tensor) -> None:
        self.live -= t.numel() * t.element_size()

    def reset_peak(self) -> None:
        self.peak = self.live


@dataclass
class CommContext:
    """What every GradSync needs to talk: the data axis, the collectives, the wire dtype and the averaging."""

    axis: AxisGroup
    collectives: Collectives
    comm_dtype: torch.dtype
    scaling: GradScaling

    def staged(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in the wire dtype, pre-scaled. In place when it already has the wire dtype: every caller's
        source is either rewritten by the reduced result or zeroed after the step, so no copy is needed."""
        out = flat if flat.dtype == self.comm_dtype else flat.to(self.comm_dtype)
        if self.scaling.pre != 1.0:
            out.mul_(self.scaling.pre)
        return out


class AllReduceGrads:
    """Stage 0: the full buffer is all-reduced in place, bucket by bucket."""

    def __init__(self, buffer: FlatGradBuffer, ctx: CommContext, meter: StagingMeter | None = None) -> None:
        self.buffer, self.ctx = buffer, ctx
        self.meter = meter if meter is not None else StagingMeter()
        self._staging: list[torch.Tensor | None] = [None] * len(buffer.layout.buckets)

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        self.buffer.absorb(index, param)

    hold = absorb  # the full buffer accumulates across backward passes already

    def _bucket(self, k: int) -> torch.Tensor:
        b = self.buffer.layout.buckets[k]
        return self.buffer.flat[b.start : b.end]

    def launch(self, k: int) -> Work:
        flat = self._bucket(k)
        staged = self.ctx.staged(flat)
        if staged is not flat:
            self.meter.add(staged)
        self._staging[k] = staged
        return self.ctx.collectives.all_reduce(staged, self.ctx.axis, async_op=True, tag="grads")

    def complete(self, k: int) -> None:
        flat, staged = self._bucket(k), self._staging[k]
        assert staged is not None
        if staged is not flat:
            flat.copy_(staged)
            self.meter.release(staged)
        if self.ctx.scaling.post != 1.0:
            flat.mul_(self.ctx.scaling.post)
        self._staging[k] = None

    def zero(self) -> None:
        self.buffer.zero()

    def forget(self, index: int) -> None:
        self.buffer.views[index].zero_()

    def reopen(self) -> None:
        """Every rank holds the same mean: averaging it again returns it (see [Note: several backward passes])."""


class _ShardReduceScatter:
    """Shared by stages 1 and 2: reduce-scatter a full bucket; this rank's reduced slice is its gradient shard.

    ``grad_shards[k]`` is where this rank keeps bucket k's reduced gradient: a slice of the full buffer (stage 1,
    so no separate shard memory) or of a contiguous fp32 shard buffer (stage 2).
    """

    def __init__(
        self, layout: ShardLayout, grad_shards: list[torch.Tensor], ctx: CommContext, meter: StagingMeter | None
    ) -> None:
        self.layout, self.grad_shards, self.ctx = layout, grad_shards, ctx
        self.meter = meter if meter is not None else StagingMeter()
        self._inflight: list[tuple[torch.Tensor, torch.Tensor, bool] | None] = [None] * len(layout.buckets)
        # [Note: compressed ZeRO gradients] in zero/compressed_grads.py: set by the stage for 1-bit Adam; while
        # active, a bucket's reduce-scatter is error-fed 1-bit and returns the mean (no pre/post scaling)
        self.compression: GradCompression | None = None
        self._compressed: set[int] = set()

    def _reduce_scatter(self, k: int, full_bucket: torch.Tensor, into: torch.Tensor | None = None) -> Work:
        """``into``: where the caller keeps the result, used as the output when it is this rank's slot of the input
        (stage 1 in the wire dtype: the all-reduce-then-slice then leaves it in place, no copies; ``Collectives``
        gives a native reduce-scatter a separate output)."""
        if self.compression is not None and self.compression.active:
            src, out, work = self.compression.launch(k, full_bucket)
            self._inflight[k] = (src, out, False)
            self._compressed.add(k)
            return work
        staged = self.ctx.staged(full_bucket)
        copied = staged is not full_bucket  # a wire-dtype copy: staging of its own (else counted by the caller)
        if copied:
            self.meter.add(staged)
        if into is not None and not copied and in_slot(into, staged, self.ctx.axis):
            out = into
        else:
            out = torch.empty(staged.numel() // self.layout.world, dtype=staged.dtype, device=staged.device)
        self._inflight[k] = (staged, out, copied)  # both must outlive the async collective
        # clobber_input: nothing reads the staged bucket after its reduction ([Note: clobbered inputs])
        return self.ctx.collectives.reduce_scatter(
            out, staged, self.ctx.axis, async_op=True, tag="grads", clobber_input=True
        )

    def _take_output(self, k: int) -> torch.Tensor:
        inflight = self._inflight[k]
        assert inflight is not None
        self._inflight[k] = None
        staged, out, copied = inflight
        if copied:
            self.meter.release(staged)
        if k in self._compressed:  # already the mean (unscaled by the loss scale: scaled back)
            self._compressed.discard(k)
            assert self.compression is not None
            self.compression.finish(k, out)
        elif self.ctx.scaling.post != 1.0:
            out.mul_(self.ctx.scaling.post)
        return out


class ReduceScatterGrads(_ShardReduceScatter):
    """Stage 1: gradients accumulate in a full fp32 buffer; the boundary reduce-scatters each bucket and writes
    the reduced result over this rank's slice of that same buffer (the optimizer's .grad views it)."""

    def __init__(
        self,
        buffer: FlatGradBuffer,
        grad_shards: list[torch.Tensor],
        ctx: CommContext,
        meter: StagingMeter | None = None,
    ) -> None:
        super().__init__(buffer.layout, grad_shards, ctx, meter)
        self.buffer = buffer

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        self.buffer.absorb(index, param)

    hold = absorb  # the full buffer accumulates across backward passes already

    def launch(self, k: int) -> Work:
        b = self.layout.buckets[k]
        return self._reduce_scatter(k, self.buffer.flat[b.start : b.end], into=self.grad_shards[k])

    def complete(self, k: int) -> None:
        out = self._take_output(k)
        if out is not self.grad_shards[k]:  # else reduced in place
            self.grad_shards[k].copy_(out)

    def zero(self) -> None:
        self.buffer.zero()

    def forget(self, index: int) -> None:
        self.buffer.views[index].zero_()  # the local part and, where this rank owns it, the reduced part

    @torch.no_grad()
    def reopen(self) -> None:
        """Each bucket: this rank's slice holds the mean, the rest stale local gradients. Keep N × mean in the
        slice and zeros elsewhere: the next reduce-scatter's sum then starts from N × mean, so the result is
        mean + mean(new) ([Note: several backward passes] in reducer.py)."""
        rank, world = self.ctx.axis.rank, self.layout.world
        for k, b in enumerate(self.layout.buckets):
            start, end = self.layout.rank_slice(k, rank)
            self.buffer.flat[b.start : start].zero_()
            self.buffer.flat[end : b.end].zero_()
            self.buffer.flat[start:end].mul_(world)


class StagedReduceScatter(_ShardReduceScatter):
    """Stage 2: only in-flight buckets exist at full size; everything else lives in the fp32 shard."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: ShardLayout,
        shard_flat: torch.Tensor,
        grad_shards: list[torch.Tensor],
        ctx: CommContext,
        meter: StagingMeter | None = None,
    ) -> None:
        super().__init__(layout, grad_shards, ctx, meter)
        self.shard_flat = shard_flat
        self.params = list(params)
        self.bucket_of = {i: k for k, b in enumerate(layout.buckets) for i in b.members}
        self._staging: dict[int, torch.Tensor] = {}
        # [Note: step-scoped hold] in zero/hold.py: per bucket, the gradients of backward passes that did not
        # communicate, in the master dtype (the shard's), allocated at a bucket's first held gradient and freed as
        # its reduction completes; all of them together are one full gradient copy (stage-1 gradient memory).
        self._held: dict[int, torch.Tensor] = {}
        self.held_bytes = 0
        self.peak_held_bytes = 0

    def _staging_for(self, k: int) -> torch.Tensor:
        staging = self._staging.get(k)
        if staging is None:
            b = self.layout.buckets[k]
            staging = torch.zeros(b.numel, dtype=self.ctx.comm_dtype, device=self.shard_flat.device)
            self._staging[k] = staging
            self.meter.add(staging)
        return staging

    def _segment(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of its bucket's staging buffer (allocated on first use)."""
        k = self.bucket_of[index]
        lo, hi = self.layout.span(index)
        start = self.layout.buckets[k].start
        return self._staging_for(k)[lo - start : hi - start]

    def held_segment(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of its bucket's held buffer (allocated, zeroed, on first use)."""
        k = self.bucket_of[index]
        held = self._held.get(k)
        if held is None:
            held = torch.zeros(self.layout.buckets[k].numel, dtype=self.shard_flat.dtype, device=self.shard_flat.device)
            self._held[k] = held
            self.held_bytes += held.numel() * held.element_size()
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        lo, hi = self.layout.span(index)
        start = self.layout.buckets[k].start
        return held[lo - start : hi - start]

    def held_buffers(self) -> list[torch.Tensor]:
        return list(self._held.values())

    def _free_held(self, k: int) -> None:
        held = self._held.pop(k, None)
        if held is not None:
            self.held_bytes -= held.numel() * held.element_size()

    def adopt(self, old: StagedReduceScatter) -> None:
        """Re-layout: carry gradients staged or held in ``old``'s buckets (none unless ``loss.backward()`` ran
        outside ``engine.backward``) into this layout's buckets, and free ``old``'s staging."""
        for k, staging in old._staging.items():
            b = old.layout.buckets[k]
            for i in b.members:
                lo, hi = old.layout.span(i)
                self._segment(i).copy_(staging[lo - b.start : hi - b.start])
            old.meter.release(staging)
        old._staging.clear()
        for k, held in list(old._held.items()):
            b = old.layout.buckets[k]
            for i in b.members:
                lo, hi = old.layout.span(i)
                self.held_segment(i).copy_(held[lo - b.start : hi - b.start])
            old._free_held(k)

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self._segment(index).add_(grad.reshape(-1))
        param.grad = None  # this rank's memory for the full gradient ends here

    def hold(self, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self.held_segment(index).add_(grad.reshape(-1))  # accumulated in the master dtype, not the wire dtype
        param.grad = None

    def launch(self, k: int) -> Work:
        held = self._held.get(k)
        if held is None:
            return self._reduce_scatter(k, self._staging_for(k))  # zeros if no member got a gradient (unused)
        staging = self._staging.pop(k, None)
        if staging is not None:  # this backward's own gradients join what earlier ones held
            held.add_(staging)
            self.meter.release(staging)
        return self._reduce_scatter(k, held)

    def complete(self, k: int) -> None:
        self.grad_shards[k].add_(self._take_output(k))
        if k in self._held:
            self._free_held(k)  # the held full bucket ends with its reduction
        else:
            self.meter.release(self._staging.pop(k))  # freed as soon as its bucket is reduced

    def zero(self) -> None:
        for staging in self._staging.values():
            self.meter.release(staging)
        self._staging.clear()
        for k in list(self._held):
            self._free_held(k)
        self.shard_flat.zero_()

    def forget(self, index: int) -> None:
        """This rank's reduced part of the parameter (its shard pieces); staging lives only within a backward."""
        k, rank = self.bucket_of[index], self.ctx.axis.rank
        if k in self._held:
            self.held_segment(index).zero_()
        start, end = self.layout.rank_slice(k, rank)
        lo, hi = self.layout.span(index)
        a, b = max(lo, start), min(hi, end)
        if a < b:
            self.grad_shards[k][a - start : b - start].zero_()

    def reopen(self) -> None:
        """Each backward's increment is reduced into the shard by itself: nothing to undo."""
