"""Stage-0 gradient reduction: bucketed all-reduce launched from gradient-ready hooks, overlapping backward.

Protocol for one backward:
  engine.before_backward(sync)  → buckets reset to ACCUMULATING, pending counts set
  hook(param) per gradient      → gradient absorbed into the flat buffer; when sync, the bucket's pending count
                                  drops, and ready buckets are launched *in bucket order* (see [Note: launch order])
  engine.after_backward()       → launch buckets whose parameters got no gradient (unused this step; their
                                  gradient is zero), wait for all, unscale into place.
On a non-boundary micro-step (or under no_sync) nothing is communicated: gradients accumulate in the buffer.

[Note: launch order] gloo and NCCL match collectives by call order. Gradients become ready in an order that can
differ between ranks (data-dependent control flow, unused parameters), so a bucket is launched only after every
lower-numbered bucket has been launched: every rank issues the same sequence of all-reduces.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.topology import AxisGroup
from shardspeed.zero.grad_buffer import FlatGradBuffer
from shardspeed.zero.layout import bucket_spans


class BucketState(enum.Enum):
    ACCUMULATING = "accumulating"  # waiting for its parameters' gradients
    REDUCING = "reducing"  # all-reduce in flight
    REDUCED = "reduced"  # averaged gradient in the buffer


@dataclass
class Bucket:
    start: int
    end: int
    members: tuple[int, ...]
    state: BucketState = BucketState.ACCUMULATING
    pending: int = 0
    work: Work | None = None
    staging: torch.Tensor | None = None  # comm-dtype copy when communication_data_type differs
    ready: set[int] = field(default_factory=set)

    def to(self, new: BucketState, expected: BucketState) -> None:
        assert self.state is expected, f"bucket [{self.start},{self.end}) is {self.state}, expected {expected}"
        self.state = new


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


class BucketedAllReduce:
    """Owns the hooks, the flat gradient buffer and the bucket state machine for one engine."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        *,
        buffer: FlatGradBuffer,
        bucket_numel: int,
        comm_dtype: torch.dtype,
        axis: AxisGroup,
        collectives: Collectives,
        scaling: GradScaling,
    ) -> None:
        self.buffer = buffer
        self.names = list(names)
        self.comm_dtype = comm_dtype
        self.axis = axis
        self.collectives = collectives
        self.scaling = scaling
        self.buckets = [Bucket(s, e, m) for s, e, m in bucket_spans(buffer.layout, bucket_numel)]
        self.bucket_of = {i: b for b in self.buckets for i in b.members}
        self._sync = False
        self._next_launch = 0
        self._in_backward = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(params)
        ]

    # --- backward protocol -------------------------------------------------------------------------------------
    def before_backward(self, sync: bool) -> None:
        assert not self._in_backward, "before_backward called twice without after_backward"
        self._in_backward, self._sync, self._next_launch = True, sync, 0
        for b in self.buckets:
            b.state, b.pending, b.ready = BucketState.ACCUMULATING, len(b.members), set()

    def _on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if not self._in_backward:
            # backward() called on a loss directly instead of engine.backward(): the gradient still lands in the
            # buffer, but nothing is reduced. engine.step() refuses to step on unreduced gradients.
            self.buffer.absorb(index, param)
            return
        bucket = self.bucket_of[index]
        if self._sync and bucket.state is not BucketState.ACCUMULATING:
            raise RuntimeError(
                f"gradient for '{self.names[index]}' arrived after its bucket was already reduced in this backward "
                "(a parameter reached twice through separate autograd graphs?). Compute one loss per backward."
            )
        self.buffer.absorb(index, param)
        if not self._sync or index in bucket.ready:
            return
        bucket.ready.add(index)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending and not force:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.to(BucketState.REDUCING, BucketState.ACCUMULATING)
        flat = self.buffer.flat[bucket.start : bucket.end]
        staged = flat if flat.dtype == self.comm_dtype else flat.to(self.comm_dtype)
        if self.scaling.pre != 1.0:
            staged.mul_(self.scaling.pre)
        bucket.staging = staged
        bucket.work = self.collectives.all_reduce(staged, self.axis, async_op=True, tag="grads")

    def after_backward(self) -> None:
        """End of backward: launch what is left (unused parameters), wait, and write averaged gradients back."""
        assert self._in_backward, "after_backward without before_backward"
        self._in_backward = False
        if not self._sync:
            return
        self._launch_ready(force=True)
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.staging is not None
            bucket.work.wait()
            flat = self.buffer.flat[bucket.start : bucket.end]
            if bucket.staging is not flat:
                flat.copy_(bucket.staging)
            if self.scaling.post != 1.0:
                flat.mul_(self.scaling.post)
            bucket.work, bucket.staging = None, None
            bucket.to(BucketState.REDUCED, BucketState.REDUCING)

    def abort_backward(self) -> None:
        """Backward raised midway: drain launched collectives so no rank is left waiting on a half sequence."""
        if not self._in_backward:
            return
        self._in_backward = False
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.staging, bucket.state = None, None, BucketState.ACCUMULATING

    @property
    def reduced(self) -> bool:
        return all(b.state is BucketState.REDUCED for b in self.buckets)

    def zero(self) -> None:
        self.buffer.zero()
        for b in self.buckets:
            b.state = BucketState.ACCUMULATING

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
