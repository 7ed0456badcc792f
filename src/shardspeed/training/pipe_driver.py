"""The pipeline's loop driver: ``train_batch`` runs a whole accumulation window as one schedule.

The second driver over ``StepCore`` ([Note: engine layout] in engine.py). Where ``MicroStepDriver`` learns about
micro-steps one ``engine.backward`` at a time, here the schedule's executor (``pipe/executor.py``) asks for each
backward, the tied-weight reduction, the data-axis reduction and the optimizer step (``StepHooks``). This module
decides what the stage's reducer does in each ([Note: pipeline driver]) and keeps the counters, events and
the loss DeepSpeed's ``train_batch`` returns.

[Note: pipeline driver] Under a pipeline the m micro-batches' backward passes interleave with p2p traffic,
and each stage holds only its layers. Hold mode (``pipeline.zero_hold: "step"``, the default): every micro-batch
backward runs the reducer with ``communicate=False`` (gradients accumulate locally, in fp32), after
``begin_hold()`` at the batch's start; then ``ReduceTiedGrads`` sums the tied weights' local gradients over the
stages holding them (``states.held_grad``), and ``ReduceGrads`` reduces everything held over the data axis once
(``states.reduce_held``), exactly as a final boundary backward would ([Note: step-scoped hold] in zero/hold.py).
Per-micro-batch mode (``"micro_batch"``, for ZeRO-2/3's memory at m× traffic): each micro-batch communicates
once, the last one final, and nothing of the hold is called (a ZeRO-3 hold begun there would keep units gathered
and gradients held, which the communicating backward would then reduce again); tied weights are refused at
construction (their sum over stages needs the unreduced local gradients).

[Note: one reduction per micro-batch] With interleaving (v chunks per rank) a micro-batch has v backward passes
on this rank, and a communicating reducer pass reduces the *whole* stage (every bucket / unit, "leftovers"
included), so communicating in each would move v× the formula's m reductions. Only the micro-batch's last chunk
backward communicates; its earlier ones hold (``communicate=False``), and the next communicating backward reduces
what they held together with its own gradients (zero/hold.py: stages 0-3 support a communicating backward after
held ones). Per step: exactly m reductions, ``pipeline_step_traffic(..., hold=False, micro_batches=m)``.

[Note: pipeline loss] The returned loss is DeepSpeed's ``agg_train_loss``: the last stage's mean over the batch's
micro-batches, averaged over the data axis, broadcast over the pipe axis, so every stage returns the same value.
It is computed just before the optimizer step (every rank is at ``OptimizerStep`` then), so the step's report
(``StepReport.loss``, the progress line on rank 0 — a first-stage rank) carries it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.faults.errors import mark_agreed
from shardspeed.topology import Topology
from shardspeed.training.micro_driver import MicroStepDriver

__all__ = ["PipeDriver", "StepHold", "aggregate_loss"]

PIPELINE_ONLY = "Only train_batch() is accessible in pipeline mode."
"""DeepSpeed's message for forward/backward/step on a pipeline engine."""


class StepHold:
    """The step-scoped hold of one stage's ``ModelStates`` ([Note: step-scoped hold] in zero/hold.py)."""

    def __init__(self, states: Any) -> None:
        self.states = states  # every stage's ModelStates has the hold (zero/states.py's protocol)

    def begin(self) -> None:
        self.states.begin_hold()

    def held_grad(self, name: str) -> torch.Tensor:
        return self.states.held_grad(name)

    def reduce(self) -> None:
        self.states.reduce_held()
        self.states.mark_grads_clean()  # the engine itself wrote the gradients ([Note: gradient markers])

    def abort(self) -> None:
        self.states.abort_hold()


def aggregate_loss(
    losses: Sequence[torch.Tensor],
    *,
    topology: Topology,
    collectives: Collectives,
    last_stage: int,
    device: torch.device,
) -> torch.Tensor:
    """[Note: pipeline loss]: the mean of ``losses`` (non-empty on the last stage only), averaged over the data
    axis, broadcast from the last stage over the pipe axis. Every rank of the pipe group must call it."""
    if topology.pipe.rank == last_stage:
        if not losses:
            raise RuntimeError("the last pipeline stage computed no loss this batch")
        loss = torch.stack([t.detach().float().reshape(()) for t in losses]).mean().reshape(1).to(device)
        if topology.data.size > 1:
            collectives.all_reduce(loss, topology.data, tag="pipe.loss")
            loss /= topology.data.size
    else:
        loss = torch.zeros(1, dtype=torch.float32, device=device)
    collectives.broadcast(loss, topology.pipe, src_index=last_stage, tag="pipe.loss")
    return loss.reshape(())


class PipeDriver(MicroStepDriver):
    """``train_batch``'s driver: implements the executor's ``StepHooks`` over the step core."""

    def bind_pipeline(
        self,
        *,
        hold: StepHold,
        per_micro_batch: bool,
        tied: Sequence[Any],
        topology: Topology,
        collectives: Collectives,
        device: torch.device,
    ) -> None:
        self.hold = hold
        self.per_micro_batch = per_micro_batch
        self.tied = list(tied)
        self.topology = topology
        self.collectives = collectives
        self.device = device
        self._final = False
        self._last_of_micro_batch = True
        self.last_loss = None
        # Every backward is announced by the executor; one that reaches this stage's parameters otherwise (a
        # script's loss.backward() through engine.module) is not a pipeline pass: refuse it instead of starting
        # a user-driven micro-step ([Note: autograd-started backward] in training/backward_passes.py).
        self.states.reducer.backward_starter = self._refuse_unannounced

    def _refuse_unannounced(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"a backward reached the pipeline engine's parameters outside train_batch(). {PIPELINE_ONLY}"
        )

    # --- the batch ------------------------------------------------------------------------------------------------
    def begin_batch(self) -> None:
        """Before the schedule's first instruction."""
        if self.passes.abort_stale():
            raise RuntimeError("train_batch(): the previous batch's backward raised before it finished")
        if self.core.host_grads:
            self.core.optimizer.forget_grads()  # a step that raised or was skipped leaves no host copies behind
        if not self.per_micro_batch:  # per micro-batch nothing of the hold is called (zero/hold.py)
            self.hold.begin()

    def abort_batch(self) -> None:
        """The schedule raised: drain what the reducer launched, drop the hold (the failure propagates)."""
        try:
            if self.passes.open:
                self.passes.abort()
        finally:
            if not self.per_micro_batch:
                self.hold.abort()
            self.core.take_stop()  # a stop agreed at a step that raised is agreed again at the next one

    # --- StepHooks ------------------------------------------------------------------------------------------------
    def _prologue(self) -> None:
        """Every pipeline backward: hold (no communication) or, per micro-batch, communicate in the micro-batch's
        last chunk backward (final on the rank's last)."""
        communicate = self.per_micro_batch and self._last_of_micro_batch  # [Note: one reduction per micro-batch]
        self.states.reducer.before_backward(communicate, final=communicate and self._final)

    def backward(self, run: Callable[[], None], final: bool, last_of_micro_batch: bool = True) -> None:
        self._final, self._last_of_micro_batch = final, last_of_micro_batch
        self.passes.start_explicit()  # sweep user clearings, then _prologue
        try:
            run()
        except BaseException:
            self.passes.abort()
            raise
        self.passes.end()

    def reduce_tied_grads(self) -> None:
        """Sum each tied weight's local gradient over the stages holding it (before the data-axis reduction)."""
        for tie in self.tied:
            if tie.axis.size == 1:
                continue
            for name in tie.names:
                self.collectives.all_reduce(self.hold.held_grad(name), tie.axis, tag=f"pipe.tied.{tie.key}")

    def reduce_grads(self) -> None:
        if not self.per_micro_batch:
            self.hold.reduce()

    def optimizer_step(self, losses: Sequence[torch.Tensor]) -> None:
        self.last_loss = aggregate_loss(
            losses,
            topology=self.topology,
            collectives=self.collectives,
            last_stage=self.topology.pipe.size - 1,
            device=self.device,
        )
        self.passes.sweep()
        with self.events.phase("step"):
            error = self._boundary_step()
        self.progress.micro_steps += self.gradient_accumulation_steps
        if error is not None:  # too many non-finite steps: agreed from the agreed norm, raised on every rank
            raise mark_agreed(error)
