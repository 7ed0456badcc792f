"""How each ZeRO stage holds and communicates gradients, one bucket at a time (driven by zero/reducer.py).

  stage 0  AllReduceGrads        full fp32 buffer; all-reduce each bucket in place on the boundary
  stage 1  ReduceScatterGrads    full fp32 buffer accumulates micro-steps; on the boundary each bucket is
                                 reduce-scattered straight into this rank's fp32 gradient shard
  stage 2  StagedReduceScatter   no full buffer: a bucket's gradients are staged only until the bucket is
                                 complete, reduce-scattered every micro-step, added into the fp32 shard, and the
                                 staging memory is released at once
Averaging over the data axis is ``pre`` before the sum and ``post`` after it (GradScaling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.topology import AxisGroup
from shardspeed.zero.grad_buffer import FlatGradBuffer
from shardspeed.zero.layout import ShardLayout


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

    def __init__(self, buffer: FlatGradBuffer, ctx: CommContext) -> None:
        self.buffer, self.ctx = buffer, ctx
        self._staging: list[torch.Tensor | None] = [None] * len(buffer.layout.buckets)

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        self.buffer.absorb(index, param)

    def _bucket(self, k: int) -> torch.Tensor:
        b = self.buffer.layout.buckets[k]
        return self.buffer.flat[b.start : b.end]

    def launch(self, k: int) -> Work:
        staged = self.ctx.staged(self._bucket(k))
        self._staging[k] = staged
        return self.ctx.collectives.all_reduce(staged, self.ctx.axis, async_op=True, tag="grads")

    def complete(self, k: int) -> None:
        flat, staged = self._bucket(k), self._staging[k]
        assert staged is not None
        if staged is not flat:
            flat.copy_(staged)
        if self.ctx.scaling.post != 1.0:
            flat.mul_(self.ctx.scaling.post)
        self._staging[k] = None

    def zero(self) -> None:
        self.buffer.zero()


class _ShardReduceScatter:
    """Shared by stages 1 and 2: reduce-scatter a full bucket; this rank's reduced slice is its gradient shard.

    ``grad_shards[k]`` is where this rank keeps bucket k's reduced gradient: a slice of the full buffer (stage 1,
    so no separate shard memory) or of a contiguous fp32 shard buffer (stage 2).
    """

    def __init__(self, layout: ShardLayout, grad_shards: list[torch.Tensor], ctx: CommContext) -> None:
        self.layout, self.grad_shards, self.ctx = layout, grad_shards, ctx
        self._inflight: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layout.buckets)

    def _reduce_scatter(self, k: int, full_bucket: torch.Tensor) -> Work:
        staged = self.ctx.staged(full_bucket)
        # A separate output: in-place reduce-scatter (output aliasing the input) is not portable across backends.
        out = torch.empty(staged.numel() // self.layout.world, dtype=staged.dtype, device=staged.device)
        self._inflight[k] = (staged, out)  # both must outlive the async collective
        return self.ctx.collectives.reduce_scatter(out, staged, self.ctx.axis, async_op=True, tag="grads")

    def _take_output(self, k: int) -> torch.Tensor:
        inflight = self._inflight[k]
        assert inflight is not None
        self._inflight[k] = None
        out = inflight[1]
        if self.ctx.scaling.post != 1.0:
            out.mul_(self.ctx.scaling.post)
        return out


class ReduceScatterGrads(_ShardReduceScatter):
    """Stage 1: gradients accumulate in a full fp32 buffer; the boundary reduce-scatters each bucket and writes
    the reduced result over this rank's slice of that same buffer (the optimizer's .grad views it)."""

    def __init__(self, buffer: FlatGradBuffer, grad_shards: list[torch.Tensor], ctx: CommContext) -> None:
        super().__init__(buffer.layout, grad_shards, ctx)
        self.buffer = buffer

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        self.buffer.absorb(index, param)

    def launch(self, k: int) -> Work:
        b = self.layout.buckets[k]
        return self._reduce_scatter(k, self.buffer.flat[b.start : b.end])

    def complete(self, k: int) -> None:
        self.grad_shards[k].copy_(self._take_output(k))

    def zero(self) -> None:
        self.buffer.zero()


class StagedReduceScatter(_ShardReduceScatter):
    """Stage 2: only in-flight buckets exist at full size; everything else lives in the fp32 shard."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: ShardLayout,
        shard_flat: torch.Tensor,
        grad_shards: list[torch.Tensor],
        ctx: CommContext,
    ) -> None:
        super().__init__(layout, grad_shards, ctx)
        self.shard_flat = shard_flat
        self.params = list(params)
        self.bucket_of = {i: k for k, b in enumerate(layout.buckets) for i in b.members}
        self._staging: dict[int, torch.Tensor] = {}
        self.peak_staging_bytes = 0

    def _staging_for(self, k: int) -> torch.Tensor:
        staging = self._staging.get(k)
        if staging is None:
            b = self.layout.buckets[k]
            staging = torch.zeros(b.numel, dtype=self.ctx.comm_dtype, device=self.shard_flat.device)
            self._staging[k] = staging
            live = sum(t.numel() * t.element_size() for t in self._staging.values())
            self.peak_staging_bytes = max(self.peak_staging_bytes, live)
        return staging

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        k = self.bucket_of[index]
        lo, hi = self.layout.span(index)
        start = self.layout.buckets[k].start
        self._staging_for(k)[lo - start : hi - start].add_(grad.reshape(-1))
        param.grad = None  # this rank's memory for the full gradient ends here

    def launch(self, k: int) -> Work:
        return self._reduce_scatter(k, self._staging_for(k))  # zeros if no member got a gradient (unused)

    def complete(self, k: int) -> None:
        self.grad_shards[k].add_(self._take_output(k))
        del self._staging[k]  # freed as soon as its bucket is reduced

    def zero(self) -> None:
        self._staging.clear()
        self.shard_flat.zero_()
