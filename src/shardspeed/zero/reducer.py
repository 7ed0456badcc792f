"""Gradient reduction driven by gradient-ready hooks: the bucket state machine shared by every ZeRO stage.

Protocol for one backward:
  before_backward(sync, final)
                         → buckets reset to ACCUMULATING, pending counts set; ``final``: this backward's
                           reduction is the last before the optimizer step
  hook(param)            → the stage's GradSync absorbs the gradient; when this backward communicates, the
                           bucket's pending count drops and ready buckets launch *in bucket order*
                           (see [Note: launch order])
  after_backward()       → launch buckets whose parameters got no gradient (unused this step: zero gradient),
                           wait for all, let the GradSync finish each bucket (copy back, scale, accumulate).
What a bucket launch *is* (all-reduce in place, reduce-scatter into a shard, …) is the GradSync's business
(zero/grad_sync.py); this module only decides *when*. ``on_final(k)`` runs as bucket k's reduced gradient of a
final backward is in place (offload copies it to the host then); while it is set, buckets whose collective has
already finished are completed during backward too, so that copy overlaps the rest of backward.

[Note: launch order] gloo and NCCL match collectives by call order. Gradients become ready in an order that can
differ between ranks (data-dependent control flow, unused parameters), so a bucket is launched only after every
lower-numbered bucket has been launched: every rank issues the same sequence of collectives.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from shardspeed.comm import Work
from shardspeed.zero.layout import ShardLayout


class GradSync(Protocol):
    """A stage's way of holding and communicating gradients, one bucket at a time."""

    def absorb(self, index: int, param: torch.nn.Parameter) -> None: ...

    def launch(self, bucket: int) -> Work: ...

    def complete(self, bucket: int) -> None: ...

    def zero(self) -> None: ...


class BucketState(enum.Enum):
    ACCUMULATING = "accumulating"  # waiting for its parameters' gradients
    REDUCING = "reducing"  # collective in flight
    REDUCED = "reduced"  # this backward's reduced gradient is in place


class GradReducer:
    """Owns the hooks and the bucket state machine for one engine."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        layout: ShardLayout,
        sync: GradSync,
        overlap: bool = True,
    ) -> None:
        self.names = list(names)
        self.overlap = overlap  # False: each bucket completes before the next launches (one bucket in flight)
        self.layout = layout
        self.grad_sync = sync
        n = len(layout.buckets)
        self.bucket_of = {i: k for k, b in enumerate(layout.buckets) for i in b.members}
        self.state = [BucketState.ACCUMULATING] * n
        self._pending = [0] * n
        self._work: list[Work | None] = [None] * n
        self._arrived: set[int] = set()  # parameters whose gradient arrived in this backward
        self._arrived_since_zero: set[int] = set()  # ... in any backward since gradients were last zeroed
        self._communicate = False
        self._final = False
        self._in_backward = False
        self.on_final: Callable[[int], None] | None = None
        self._next_launch = 0
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(params)
        ]

    def _to(self, bucket: int, new: BucketState, expected: BucketState) -> None:
        assert self.state[bucket] is expected, f"bucket {bucket} is {self.state[bucket]}, expected {expected}"
        self.state[bucket] = new

    def before_backward(self, communicate: bool, final: bool = False) -> None:
        assert not self._in_backward, "before_backward called twice without after_backward"
        self._in_backward, self._communicate, self._next_launch = True, communicate, 0
        self._final = final and communicate
        self._arrived.clear()
        for k, b in enumerate(self.layout.buckets):
            self.state[k], self._pending[k] = BucketState.ACCUMULATING, len(b.members)

    def _on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if not self._in_backward:
            # loss.backward() called directly instead of engine.backward(loss): the gradient is kept, nothing is
            # reduced, and engine.step() refuses to step on unreduced gradients.
            self.grad_sync.absorb(index, param)
            return
        self._arrived_since_zero.add(index)
        bucket = self.bucket_of[index]
        if self._communicate and self.state[bucket] is not BucketState.ACCUMULATING:
            raise RuntimeError(
                f"gradient for '{self.names[index]}' arrived after its bucket was already reduced in this backward "
                "(a parameter reached twice through separate autograd graphs?). Compute one loss per backward."
            )
        self.grad_sync.absorb(index, param)
        if not self._communicate or index in self._arrived:
            return
        self._arrived.add(index)
        self._pending[bucket] -= 1
        self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next_launch < len(self.state):
            k = self._next_launch
            if self._pending[k] and not force:
                return
            self._to(k, BucketState.REDUCING, BucketState.ACCUMULATING)
            self._work[k] = self.grad_sync.launch(k)
            self._next_launch += 1
            if not self.overlap:
                self._finish(k)
        if self._final and self.on_final is not None:
            for k in range(self._next_launch):  # finished collectives: complete them now, not after backward
                work = self._work[k]
                if self.state[k] is BucketState.REDUCING and work is not None and work.done():
                    self._finish(k)

    def _finish(self, k: int) -> None:
        work = self._work[k]
        assert work is not None
        work.wait()
        self._work[k] = None
        self.grad_sync.complete(k)
        self._to(k, BucketState.REDUCED, BucketState.REDUCING)
        if self._final and self.on_final is not None:
            self.on_final(k)

    def after_backward(self) -> None:
        """End of backward: launch what is left (unused parameters), wait, finish every bucket."""
        assert self._in_backward, "after_backward without before_backward"
        self._in_backward = False
        if not self._communicate:
            return
        self._launch_ready(force=True)
        for k, state in enumerate(self.state):
            if state is BucketState.REDUCING:
                self._finish(k)

    def abort_backward(self) -> None:
        """Backward raised midway: drain launched collectives so this rank's sequence is not left half-issued."""
        if not self._in_backward:
            return
        self._in_backward = False
        for k, work in enumerate(self._work):
            if work is not None:
                work.wait()
            self._work[k], self.state[k] = None, BucketState.ACCUMULATING

    @property
    def reduced(self) -> bool:
        """Whether the last backward reduced every bucket (required before an optimizer step)."""
        return all(s is BucketState.REDUCED for s in self.state)

    def unused_names(self) -> list[str]:
        """Trainable parameters that got no gradient in any backward since gradients were last zeroed."""
        return [n for i, n in enumerate(self.names) if i not in self._arrived_since_zero]

    def zero(self) -> None:
        self._arrived_since_zero.clear()
        self.grad_sync.zero()
        self.state = [BucketState.ACCUMULATING] * len(self.state)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
