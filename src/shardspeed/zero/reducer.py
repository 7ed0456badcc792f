"""Gradient reduction driven by gradient-ready hooks: the bucket state machine shared by ZeRO stages 0, 1 and 2.

Protocol for one backward:
  before_backward(sync, final)
                         → buckets reset to ACCUMULATING, pending counts set; ``final``: this backward's
                           reduction is the last before the optimizer step
  hook(param)            → the stage's GradSync absorbs the gradient; when this backward communicates, the
                           bucket's pending count drops and ready buckets launch *in bucket order*
                           (see [Note: launch order]); with ``max_in_flight`` buckets in flight the oldest is
                           finished before the next launches (see [Note: bounded reductions])
  after_backward()       → launch buckets whose parameters got no gradient (unused this step: zero gradient),
                           wait for all, let the GradSync finish each bucket (copy back, scale, accumulate).
What a bucket launch *is* (all-reduce in place, reduce-scatter into a shard, …) is the GradSync's business
(zero/grad_sync.py); this module only decides *when*. ``on_final(k)`` runs as bucket k's reduced gradient of a
final backward is in place (offload copies it to the host then); while it is set, buckets whose collective has
already finished are completed during backward too, so that copy overlaps the rest of backward.

[Note: launch order] gloo and NCCL match collectives by call order. Gradients become ready in an order that can
differ between ranks (data-dependent control flow, unused parameters), so a bucket is launched only after every
lower-numbered bucket has been launched: every rank issues the same sequence of collectives. For that to overlap
anything, bucket order must follow the order gradients become ready — which is why the layout is rebuilt from the
first backward's arrival order ([Note: arrival-order layout] in zero/arrival_order.py). During that first
("recording") backward nothing is absorbed or launched: the hooks only record the order; after autograd returns,
``plan_layout`` re-lays the buckets out and the arrivals are replayed in the new bucket order.

[Note: bounded reductions] A launched bucket holds its staging memory until it is finished. Finishing every bucket
only at the end of backward keeps all of them alive at once (a whole fp32 gradient copy at stage 2), so at most
``max_in_flight`` buckets are in flight: before launching one more, the oldest is finished (waited for and
completed), during backward. With gradients arriving in bucket order the staging alive is then at most
``max_in_flight`` + 1 buckets (the one filling). ``REDUCTIONS_IN_FLIGHT`` = 2, as ZeRO-3's
REDUCE_SCATTERS_IN_FLIGHT: one bucket's collective runs while the next is launched; more only buys memory.
``overlap_comm: false`` is a cap of 0: each bucket is finished as it launches.

[Note: several backward passes] As in torch, gradients of every backward accumulate until they are zeroed: a
second backward before ``step()`` (two losses, or another engine's loss flowing through this module: a GAN's
generator loss through the discriminator) adds to what is held. On a boundary each backward reduces; when one
follows an already reduced backward, ``before_backward`` asks the GradSync to ``reopen`` its buffers so the
reduced part is not averaged again: stage 0 holds the same mean on every rank, whose average is itself; stage 1
keeps N × its reduced slice and zeroes the rest of the bucket (the sum over ranks is then N × mean); stage 2 (and
ZeRO-3) reduce each backward's own increment into the shard already. A backward is started by
``engine.backward`` or by autograd itself (``loss.backward()``): the first hook calls ``backward_starter``
(training/backward_passes.py), which runs ``before_backward`` and queues ``after_backward`` at the end of the
graph task. Between backward passes ``param.grad`` holds a marker ([Note: gradient markers] in grad_markers.py)
so a script's own ``zero_grad`` is noticed and the parameter's gradient forgotten (``forget``).
"""

from __future__ import annotations

import collections
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from shardspeed.comm import Work
from shardspeed.log import logger
from shardspeed.zero.grad_markers import GradMarkers
from shardspeed.zero.layout import ShardLayout


class GradSync(Protocol):
    """A stage's way of holding and communicating gradients, one bucket at a time."""

    def absorb(self, index: int, param: torch.nn.Parameter) -> None: ...

    def hold(self, index: int, param: torch.nn.Parameter) -> None:
        """A backward that does not communicate: keep the gradient, accumulated in the master dtype, until a later
        reduction ([Note: step-scoped hold] in zero/hold.py). Stages 0/1: ``absorb`` (their flat buffer)."""
        ...

    def launch(self, bucket: int) -> Work: ...

    def complete(self, bucket: int) -> None: ...

    def zero(self) -> None: ...

    def forget(self, index: int) -> None:
        """Drop parameter ``index``'s accumulated gradient (user code cleared its ``.grad``)."""
        ...

    def reopen(self) -> None:
        """Another backward follows a reduction before the step: make the held gradients such that reducing
        them again plus the new ones yields reduced + mean(new) ([Note: several backward passes])."""
        ...


class BucketState(enum.Enum):
    ACCUMULATING = "accumulating"  # waiting for its parameters' gradients
    REDUCING = "reducing"  # collective in flight
    REDUCED = "reduced"  # this backward's reduced gradient is in place


REDUCTIONS_IN_FLIGHT = 2  # see [Note: bounded reductions]


class GradReducer:
    """Owns the hooks and the bucket state machine for one engine."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        layout: ShardLayout,
        sync: GradSync,
        overlap: bool = True,
        max_in_flight: int = REDUCTIONS_IN_FLIGHT,
    ) -> None:
        self.params, self.names = list(params), list(names)
        # overlap False: each bucket completes before the next launches (one bucket in flight)
        self.max_in_flight = max_in_flight if overlap else 0
        self._arrived: set[int] = set()  # parameters whose gradient arrived in this backward
        self._arrived_since_zero: set[int] = set()  # ... in any backward since gradients were last zeroed
        self._communicate = False
        self._final = False
        self._in_backward = False
        self.on_final: Callable[[int], None] | None = None
        # plan_layout(order): re-lays the buckets out from the first backward's arrival order (collective; calls
        # set_layout). None: the layout is fixed (planned already, or a streamed offload optimizer).
        # Returns whether buckets now follow the agreed arrival order.
        self.plan_layout: Callable[[list[int]], bool] | None = None
        self._recording = False
        self._order: list[int] = []  # arrival order of the recording backward
        self._last_bucket = -1  # highest bucket that got a gradient in this backward (order-change detection)
        self._order_changed_logged = False
        self._planned = False  # plan_layout has run
        self._inflight: collections.deque[int] = collections.deque()
        # called by the first hook of a backward nobody announced (loss.backward()): starts it (before_backward)
        self.backward_starter: Callable[[], None] | None = None
        self.markers = GradMarkers(self.params)  # the stage sets buffer views where .grad views the buffer
        self.set_layout(layout, sync)
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(params)
        ]
        self._hooks += [p.register_hook(functools.partial(self._before_accumulate, i)) for i, p in enumerate(params)]

    def set_layout(self, layout: ShardLayout, sync: GradSync) -> None:
        """Adopt a new bucket layout and the GradSync built for it (same parameters, same indices)."""
        assert not self._inflight, "re-layout with collectives in flight"
        self.layout, self.grad_sync = layout, sync
        n = len(layout.buckets)
        self.bucket_of = {i: k for k, b in enumerate(layout.buckets) for i in b.members}
        self.state = [BucketState.ACCUMULATING] * n
        self._pending = [len(b.members) for b in layout.buckets]
        self._work: list[Work | None] = [None] * n
        self._next_launch = 0

    def _to(self, bucket: int, new: BucketState, expected: BucketState) -> None:
        assert self.state[bucket] is expected, f"bucket {bucket} is {self.state[bucket]}, expected {expected}"
        self.state[bucket] = new

    def before_backward(self, communicate: bool, final: bool = False) -> None:
        assert not self._in_backward, "before_backward called twice without after_backward"
        self._in_backward, self._communicate, self._next_launch = True, communicate, 0
        self._final = final and communicate
        self._recording = self.plan_layout is not None
        if any(state is BucketState.REDUCED for state in self.state):  # [Note: several backward passes]
            self.grad_sync.reopen()
        self._arrived.clear()
        self._order.clear()
        self._last_bucket = -1
        for k, b in enumerate(self.layout.buckets):
            self.state[k], self._pending[k] = BucketState.ACCUMULATING, len(b.members)

    def _before_accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Tensor pre-hook (before AccumulateGrad): start an unannounced backward; clear a sentinel ``.grad``."""
        if not self._in_backward and self.backward_starter is not None:
            self.backward_starter()
        self.markers.before_accumulate(index)

    def _on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if not self._in_backward:
            # no driver (the reducer used on its own): the gradient is kept, nothing is reduced
            self.grad_sync.absorb(index, param)
            return
        self._arrived_since_zero.add(index)
        if self._recording:  # only the order; absorbed and reduced after the re-layout ([Note: launch order])
            if index not in self._arrived:
                self._arrived.add(index)
                self._order.append(index)
            return
        self._receive(index, param)

    def _receive(self, index: int, param: torch.nn.Parameter) -> None:
        bucket = self.bucket_of[index]
        if self._communicate and self.state[bucket] is not BucketState.ACCUMULATING:
            raise RuntimeError(
                f"gradient for '{self.names[index]}' arrived after its bucket was already reduced in this backward "
                "(reached again after its bucket's gradients were all in, e.g. through a nested autograd graph joined "
                "into this backward). Run separate backward passes instead: gradients of several backward passes "
                "accumulate."
            )
        if self._communicate:
            self.grad_sync.absorb(index, param)
        else:  # [Note: step-scoped hold] in zero/hold.py
            self.grad_sync.hold(index, param)
        self.markers.install(index)
        if not self._communicate or index in self._arrived:
            return
        self._arrived.add(index)
        self._note_order(index, bucket)
        self._pending[bucket] -= 1
        self._launch_ready(force=False)

    def _note_order(self, index: int, bucket: int) -> None:
        """Log once when gradients stop arriving in bucket order after the layout was planned (not re-laid: the
        layout, masters and optimizer shards stay; only overlap and staging memory suffer)."""
        if bucket < self._last_bucket and self._planned and not self._order_changed_logged:
            self._order_changed_logged = True
            logger.warning(
                "gradient arrival order changed since the bucket layout was planned (first backward): '%s' arrived "
                "after a later bucket's gradient; buckets keep their layout, so less communication overlaps backward",
                self.names[index],
            )
        self._last_bucket = max(self._last_bucket, bucket)

    def _launch_ready(self, force: bool) -> None:
        while self._next_launch < len(self.state):
            k = self._next_launch
            if self._pending[k] and not force:
                break
            while self._inflight and len(self._inflight) >= self.max_in_flight:  # [Note: bounded reductions]
                self._finish(self._inflight[0])
            self._to(k, BucketState.REDUCING, BucketState.ACCUMULATING)
            self._work[k] = self.grad_sync.launch(k)
            self._inflight.append(k)
            self._next_launch += 1
            if self.max_in_flight == 0:  # overlap_comm off
                self._finish(k)
        if self._final and self.on_final is not None:
            for k in list(self._inflight):  # finished collectives: complete them now, not after backward
                work = self._work[k]
                if work is not None and work.done():
                    self._finish(k)

    def _finish(self, k: int) -> None:
        work = self._work[k]
        assert work is not None
        work.wait()
        self._work[k] = None
        self._inflight.remove(k)
        self.grad_sync.complete(k)
        self._to(k, BucketState.REDUCED, BucketState.REDUCING)
        if self._final and self.on_final is not None:
            self.on_final(k)

    def after_backward(self) -> None:
        """End of backward: re-lay out after the recording backward, launch what is left (unused parameters),
        wait, finish every bucket."""
        assert self._in_backward, "after_backward without before_backward"
        if self._recording:
            self._recording = False
            plan, self.plan_layout = self.plan_layout, None
            assert plan is not None
            self._planned = plan(list(self._order))  # collective over the data axis; calls set_layout
            arrived = set(self._arrived)
            self._arrived.clear()
            for i in self.layout.placement:  # replay in the new bucket order: buckets fill and launch one by one
                if i in arrived:
                    self._receive(i, self.params[i])
        self._in_backward = False
        if not self._communicate:
            return
        self._launch_ready(force=True)
        while self._inflight:
            self._finish(self._inflight[0])

    def reduce_held(self) -> None:
        """Reduce what the backward passes since the last step held (``communicate=False``) exactly as a final
        boundary backward would, with no new gradients: every bucket launches (in bucket order), ``on_final`` fires,
        ``reduced`` is True after ([Note: step-scoped hold] in zero/hold.py). If no backward ran since the stage
        was built, the layout is planned here (an empty arrival order: the current placement)."""
        self.before_backward(communicate=True, final=True)
        self.after_backward()

    def abort_backward(self) -> None:
        """Backward raised midway: drain launched collectives so this rank's sequence is not left half-issued."""
        if not self._in_backward:
            return
        self._in_backward = self._recording = False
        for k, work in enumerate(self._work):
            if work is not None:
                work.wait()
            self._work[k], self.state[k] = None, BucketState.ACCUMULATING
        self._inflight.clear()

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
        self.markers.install_all()

    def forget(self, indices: Sequence[int]) -> None:
        """User code cleared these parameters' ``.grad`` since: drop what the stage accumulated for them (on a
        boundary that can be reduced data: every rank clears the same parameters in a sane script)."""
        assert not self._in_backward, "forget during backward"
        for i in indices:
            self.grad_sync.forget(i)
            self.markers.install(i)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
