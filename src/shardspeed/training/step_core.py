"""One optimizer step at an accumulation boundary, every decision agreed world-wide.

norm → overflow → unscale × clip → optimizer step → copy back → LR schedule → loss-scale update → zero gradients.

[Note: agreed step] Each decision here must come out the same on every rank of the *world* (every axis: data,
tensor, pipe), or ranks step differently and diverge silently (or one waits in a collective the others skipped).
The global norm is computed from reduced gradients, each element counted once: local sums of squares, with
tensor-replicated parameters counted on tensor rank 0 only, added over the model scope (pipe × tensor) and, where
the stage shards gradients over the data axis, over the data axis too (one all-reduce over the world; [Note: norm
counted once] in precision/norm_weights.py). A data-parallel-only model pays what it did before: no collective at
stage 0, one scalar all-reduce over the data axis at stages 1-3. So the overflow verdict and the clip coefficient
are identical everywhere; the unused-parameter check, the count of gradient clearings since the last step, whether
every rank reduced this step's gradients and a pending preemption stop are one small all-reduce over the world.
Nothing in the step may depend on a rank-local value that was not agreed first. An optimizer that owns
communication (1-bit Adam's compressed phase) steps on local gradients, which differ between ranks: a norm is one
all-reduce of the local sums of squares ([Note: optimizer-owned communication] in compression/optim_base.py).
When nothing computes the norm the verdict must still be agreed (one rank's NaN folded into its momentum would
reach every rank through the compressed mean, and stay in its error buffers), so each rank classifies its local
sum of squares (finite / inf / NaN) and the kind rides in the step checks' MAX all-reduce: no collective, no
norm of its own (the reported norm stays None). The non-finite verdict (fp32/bf16
skip, fp16 overflow) follows from the agreed norm, so the consecutive-skip counters advance alike everywhere;
locating the first offending parameter is one more small collective over the world, issued only on that path
([Note: non-finite steps] in ``nonfinite.py``).

The loop drivers (``micro_driver.py``, the pipeline's ``pipe_driver.py``) decide *when* to call ``run``; this
module decides nothing about micro-steps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.compression.engine_wiring import owns_communication
from shardspeed.faults.errors import mark_agreed
from shardspeed.params.spec import ParamSpecs
from shardspeed.precision.grad_norm import clip_coefficient
from shardspeed.precision.loss_scaler import LossScaler
from shardspeed.precision.norm_weights import NormScope
from shardspeed.topology import AxisGroup, Topology
from shardspeed.training.nonfinite import NonFiniteGuard, agree_first_nonfinite

__all__ = ["StepCore", "StepOutcome"]


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float | None
    """Unscaled global norm before clipping; None when the caller did not need it and nothing else did."""
    skipped: bool
    """fp16 overflow, or NaN/Inf gradients under fp32/bf16: the optimizer did not step."""
    error: Exception | None = None
    """Raise after the step is counted: too many consecutive non-finite steps / fp16 overflows at min scale."""


def decision_scope(topology: Topology) -> AxisGroup:
    """The ranks every step decision is agreed over: the world (every topology has one, an mpu's too)."""
    return topology.world


class StepCore:
    """The boundary step of one engine. ``states`` is the stage's ``ModelStates``; ``optimizer`` the (possibly
    offloaded) optimizer; ``host_grads`` is True when an offload optimizer keeps host copies of the gradients
    (then it, not the stage, scales and forgets them; the norm is still the stage's). ``param_specs``: which
    parameters are split over the tensor axis (the rest are counted in the norm on tensor rank 0 only)."""

    def __init__(
        self,
        *,
        states: Any,
        optimizer: Any,
        lr_scheduler: Any,
        loss_scaler: LossScaler | None,
        gradient_clipping: float,
        ignore_unused_parameters: bool,
        host_grads: bool,
        topology: Topology,
        param_specs: ParamSpecs,
        collectives: Collectives,
        device: torch.device,
        logger: logging.Logger,
        global_rank: int,
        nonfinite: NonFiniteGuard,
        stop_requested: Callable[[], int] = lambda: 0,
    ) -> None:
        self.states = states
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.ignore_unused_parameters = ignore_unused_parameters
        self.host_grads = host_grads
        self.axis = decision_scope(topology)
        """Every rank: the step checks and the first non-finite parameter are agreed over it."""
        self.collectives = collectives
        self.device = device
        self.logger = logger
        self.global_rank = global_rank
        self.stop_requested = stop_requested
        """This rank's pending preemption signal number, 0 for none (faults/preemption.py)."""
        self.agreed_stop = 0
        """The largest pending signal number across ranks at the last boundary: the caller stops after the step."""
        self.nonfinite = nonfinite
        states.bind_norm(NormScope.for_topology(topology, param_specs, nonfinite.order))

    def run(
        self, *, want_norm: bool, step_index: int, clearings: int = 0, lr_kwargs: dict[str, Any] | None = None
    ) -> StepOutcome:
        """Step on this boundary's reduced gradients. ``want_norm``: the caller reports the norm this step (the
        norm costs a pass over the gradients and a host sync, so, as in DeepSpeed, it is computed only when
        clipping, fp16 overflow detection, a report or ``skip_nonfinite_steps: true`` uses it). ``step_index``
        (0-based) only labels log lines and errors, which show it 1-based, as ``global_steps`` after the step.
        ``clearings``: how many times user code cleared gradients since the last step ([Note: gradient markers]);
        it must be the same on every rank (checked with the unused-parameter check, in one collective).
        ``lr_kwargs`` go to the LR scheduler's ``step`` (DeepSpeed's ``engine.step(lr_kwargs=...)``)."""
        # [Note: overlapped parameter gather]: the last step's gathers (stages 1/2) land before anything here; fp32
        # steps the parameter buffer's own slices, which a pending gather is still writing
        self.states.wait_params()
        scaler = self.loss_scaler
        loss_scale = scaler.scale if scaler else 1.0
        computed = want_norm or self.gradient_clipping > 0 or scaler is not None or self.nonfinite.forces_norm
        # local gradients, and nothing computes the norm: the verdict rides in the step checks ([Note: agreed step])
        local_verdict = not computed and owns_communication(self.optimizer)
        here = _nonfinite_kind(self.states.local_grad_sq_sum()) if local_verdict else 0.0  # stage 0's states
        anywhere = self._agree_before_step(clearings, here)
        self.states.verify_unit_order()  # ZeRO-3's deferred unit-id checks
        norm = math.sqrt(self.states.grad_sq_sum()) / loss_scale if computed else _KIND_NORM[anywhere]
        step, error = step_index + 1, None  # 1-based in reports, as global_steps after the step
        if scaler is None:  # fp32/bf16: [Note: non-finite steps] in nonfinite.py
            skipped, error = self.nonfinite.fp32_verdict(
                norm, computed or local_verdict, step, self._first_nonfinite, self.logger, self.global_rank == 0
            )
        else:
            skipped = not math.isfinite(norm)
        if skipped and scaler is not None:
            at_min = scaler.at_minimum
            message = scaler.update(overflow=True)
            if self.global_rank == 0 and message:
                self.logger.info("step %d: %s", step, message)
            error = self.nonfinite.fp16_overflow(step, at_min, loss_scale, self._first_nonfinite)
        elif not skipped:
            coef = clip_coefficient(norm, self.gradient_clipping) / loss_scale
            if coef != 1.0:  # offload with host copies of the gradients: the optimizer scales those
                (self.optimizer.scale_grads if self.host_grads else self.states.scale_grads)(coef)
            self.optimizer.step()
            self.states.after_optimizer_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            if scaler is not None:
                scaler.update(overflow=False)
                self.nonfinite.fp16_clean()
        self.zero_grads()
        return StepOutcome(grad_norm=norm if computed else None, skipped=skipped, error=error)

    def _first_nonfinite(self) -> str | None:
        """The first parameter (registration order) with a NaN/Inf gradient on any rank: one small collective."""
        return agree_first_nonfinite(
            self.states.nonfinite_grad_names(), self.nonfinite.order, self.collectives, self.axis, self.device
        )

    def take_stop(self) -> int:
        """The agreed preemption signal of the last boundary (0: none), once: the caller acts on it."""
        stop, self.agreed_stop = self.agreed_stop, 0
        return stop

    def zero_grads(self) -> None:
        """Forget every gradient accumulated since the last step (flat buffers, shards, host copies)."""
        self.states.zero_grads()
        self.states.mark_grads_clean()
        if self.host_grads:
            self.optimizer.forget_grads()

    def _agree_before_step(self, clearings: int, nonfinite: float = 0.0) -> float:
        """One small all-reduce (MAX) issued on every rank, so all ranks raise together instead of some hanging or
        stepping on different gradients; returns the agreed ``nonfinite`` kind (0 finite, 1 inf, 2 NaN somewhere:
        this rank's local gradients' kind, for an optimizer that owns communication when no norm is computed):
        - ``ignore_unused_parameters: false``: whether any rank saw a trainable parameter without gradient;
        - gradient clearings since the last step: a rank that zeroed (possibly reduced, agreed) gradients the
          others kept would step on different gradients, silently at stage 0 (replicated parameters);
        - a pending preemption signal (its number): one rank may get it a step before another, or alone, so the
          stop after this step is decided here, on every rank alike (``agreed_stop``)."""
        unused = [] if self.ignore_unused_parameters else self.states.reducer.unused_names()
        unreduced = not self.states.reducer.reduced
        stop = float(self.stop_requested())
        flags = torch.tensor(
            [float(len(unused)), float(clearings), -float(clearings), float(unreduced), stop, nonfinite],
            device=self.device,
        )
        self.collectives.all_reduce_max(flags, self.axis, tag="step_checks")
        any_unused, most, neg_least, any_unreduced, agreed_stop, agreed_nonfinite = flags.tolist()  # one host read
        least = -neg_least
        self.agreed_stop = int(agreed_stop)
        if most != least:
            raise mark_agreed(  # decided from the all-reduced flags: every rank raises here
                RuntimeError(
                    f"gradients were cleared (zero_grad on the module, the optimizer or the engine) "
                    f"{clearings} time(s) "
                    f"on this rank since the last step, but between {least:.0f} and {most:.0f} times across the "
                    "ranks: every rank must clear its gradients alike, or ranks step on different "
                    "gradients"
                )
            )
        if any_unreduced > 0:
            where = "this rank's" if unreduced else "another (data-, tensor- or pipeline-parallel) rank's"
            raise mark_agreed(  # decided from the all-reduced flags: every rank raises here
                RuntimeError(
                    f"step() at a gradient-accumulation boundary, but {where} gradients of this step were never "
                    "all-reduced: no backward since zero_grad(), or the boundary backward ran under no_sync(). Ranks "
                    "would step on different gradients and diverge."
                )
            )
        if any_unused > 0:
            elsewhere = "on another data-parallel rank or tensor/pipeline rank"
            where = f"here: {', '.join(unused[:5])}" if unused else elsewhere
            raise mark_agreed(  # decided from the all-reduced flags: every rank raises here
                RuntimeError(
                    f"parameters received no gradient this step ({where}) and zero_optimization."
                    "ignore_unused_parameters is false; set it to true (the default) to give them zero gradients"
                )
            )
        return agreed_nonfinite


_KIND_NORM = {0.0: 0.0, 1.0: math.inf, 2.0: math.nan}
"""The norm an agreed non-finite kind stands for (what an all-reduce of the ranks' sums would give: NaN wins)."""


def _nonfinite_kind(sq_sum: float) -> float:
    """0 for a finite sum of squares, 1 for inf (overflow or an inf gradient), 2 for NaN: MAX-reducible."""
    return 0.0 if math.isfinite(sq_sum) else (2.0 if math.isnan(sq_sum) else 1.0)
