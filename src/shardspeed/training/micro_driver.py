"""The user-driven training loop: ``engine.backward(loss)`` then ``engine.step()``, micro-step by micro-step.

Owns what happens between optimizer steps: scaling the loss by 1/GAS (× fp16's loss scale), telling the stage's
reducer whether this backward is the accumulation boundary (and whether to communicate at all under
``no_sync()``), counting micro-steps, and calling the ``StepCore`` on the boundary. The pipeline's ``train_batch``
is a second driver over the same step core (``pipe_driver.py``, a subclass: same counters and boundary step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import torch

from shardspeed.faults.errors import mark_agreed
from shardspeed.training.backward_passes import BackwardPasses
from shardspeed.training.events import EngineEvents, StepReport
from shardspeed.training.step_core import StepCore

__all__ = ["MicroStepDriver", "Progress"]


@dataclass
class Progress:
    """The loop's counters (saved in checkpoints; DeepSpeed exposes them as engine attributes)."""

    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0


class MicroStepDriver:
    def __init__(
        self,
        *,
        states: Any,
        core: StepCore,
        events: EngineEvents,
        gradient_accumulation_steps: int,
        train_batch_size: int,
        steps_per_print: int,
        get_lr: Callable[[], list[float]],
    ) -> None:
        self.states = states
        self.core = core
        self.events = events
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.train_batch_size = train_batch_size
        self.steps_per_print = steps_per_print
        self.get_lr = get_lr
        self.progress = Progress()
        self.global_grad_norm: float | None = None
        self.norm_every_step = False  # the monitors log grad_norm every step (monitor/listener.py)
        self.last_loss: torch.Tensor | None = None
        self._boundary_override: bool | None = None
        self._no_sync = False
        self.cleared_since_step = 0  # user clearings of gradients seen since the last step ([Note: gradient markers])
        self.passes = BackwardPasses(
            states=states,
            prologue=self._prologue,
            gradient_accumulation_steps=lambda: self.gradient_accumulation_steps,
            needs_loss_scale=core.loss_scaler is not None,
            on_forget=self._forgot,
            events=events,
        )
        # hooks of a backward nobody announced (loss.backward()) start it: training/backward_passes.py
        states.reducer.backward_starter = self.passes.start_from_autograd

    @classmethod
    def for_engine(cls, engine: Any) -> Self:
        """The driver of ``engine`` (its states, step core, events and the config's batch arithmetic)."""
        c = engine.config
        return cls(
            states=engine.states,
            core=engine._core,
            events=engine.events,
            gradient_accumulation_steps=c.gradient_accumulation_steps,
            train_batch_size=c.train_batch_size,
            steps_per_print=c.steps_per_print,
            get_lr=engine.get_lr,
        )

    # --- accumulation boundaries --------------------------------------------------------------------------------
    def is_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.progress.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.states.communicate_every_micro_step:
            raise RuntimeError(
                "no_sync() cannot be used with ZeRO stage 2: gradients are reduce-scattered into shards on every "
                "backward (as in DeepSpeed). Use gradient_accumulation_steps instead."
            )
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # --- the loop -------------------------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)`` for a manual ``loss.backward()``: the loss times fp16's loss scale
        (1/GAS is applied by the forward outputs' hooks, as in DeepSpeed)."""
        if loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError("engine.scale(loss) expects a scalar loss with a grad_fn")
        self.passes.scale_called = True
        self.last_loss = loss.detach()
        scaler = self.core.loss_scaler
        return loss.float() * scaler.scale if scaler is not None else loss

    def _prologue(self) -> None:
        """Before any backward of this engine, however started: the boundary decision and the reducer."""
        boundary = self.is_boundary()
        communicate = (boundary or self.states.communicate_every_micro_step) and not self._no_sync
        if self.core.host_grads and boundary and communicate:
            self.core.optimizer.forget_grads()  # a step that raised or was skipped leaves no copies or scale behind
        self.states.reducer.before_backward(communicate, final=boundary)

    def _forgot(self, events: int) -> None:
        self.cleared_since_step += 1  # one clearing (however many parameters it reached): compared across ranks
        if self.core.host_grads:
            self.core.optimizer.forget_grads()  # host copies of forgotten gradients: taken again at the step

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if loss.numel() != 1:
            raise ValueError(f"backward expects a scalar loss, got shape {tuple(loss.shape)}")
        self.last_loss = loss.detach()
        self._refuse_stale_pass("backward()")
        scale = 1.0 / self.gradient_accumulation_steps if scale_wrt_gas else 1.0
        if self.core.loss_scaler is not None:
            scale *= self.core.loss_scaler.scale
        self.passes.start_explicit()
        with self.events.phase("backward"):
            try:
                (loss.float() * scale).backward(retain_graph=retain_graph)
            except BaseException as err:
                self.passes.abort()
                # ZeRO-3 names a parameter read as an empty placeholder; anything else is raised as it came
                explained = self.states.explain_backward_error(err, loss)
                if explained is err:
                    raise
                raise explained from err
            self.passes.end()
        return loss

    def zero_grad(self) -> None:
        """``engine.zero_grad()``: forget every gradient accumulated since the last step."""
        self._refuse_stale_pass("zero_grad()")
        self.core.zero_grads()
        self.cleared_since_step += 1

    def _refuse_stale_pass(self, where: str) -> None:
        """A backward of this engine that autograd started (``loss.backward()``) and that raised midway is aborted
        here. Alone, the script may retry (e.g. after an out-of-memory error). With data-parallel peers it may not:
        they launched this pass's reductions and wait for this rank's half, so this rank's next reductions would
        pair with theirs one pass off. Raised unagreed, so the failure guard publishes it to every rank."""
        if self.passes.abort_stale() and self.core.axis.size > 1:
            raise RuntimeError(
                f"{where}: a backward of this engine (loss.backward()) raised on this rank before its gradients were "
                "reduced; the other data-parallel ranks wait for those reductions, so the ranks can no longer train "
                "in step (skipping a batch whose backward failed on one rank is not possible with data parallelism)"
            )

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Optimizer step at the accumulation boundary; otherwise only counts the micro-step."""
        if self.passes.abort_stale():
            raise RuntimeError(
                "step(): the last backward raised before it finished, so its gradients were never reduced; "
                "zero_grad() and run the backward again"
            )
        self.passes.sweep()
        error = None
        if self.is_boundary():
            with self.events.phase("step"):
                error = self._boundary_step(lr_kwargs)
        self.progress.micro_steps += 1
        self._boundary_override = None
        if error is not None:  # too many non-finite steps: raised once the step is counted, so nothing drifts
            # Agreed: decided from the agreed norm, so every rank raises it at the same step; not a failure to publish.
            raise mark_agreed(error)

    def _boundary_step(self, lr_kwargs: dict[str, Any] | None = None) -> Exception | None:
        progress = self.progress
        reporting = (progress.global_steps + 1) % self.steps_per_print == 0 or self.norm_every_step
        clearings, self.cleared_since_step = self.cleared_since_step, 0
        outcome = self.core.run(
            want_norm=reporting, step_index=progress.global_steps, clearings=clearings, lr_kwargs=lr_kwargs
        )
        self.global_grad_norm = outcome.grad_norm
        progress.skipped_steps += outcome.skipped
        progress.global_steps += 1
        progress.global_samples += self.train_batch_size
        scaler = self.core.loss_scaler
        self.events.step(
            StepReport(
                global_step=progress.global_steps,
                global_samples=progress.global_samples,
                loss=self.last_loss,
                lr=tuple(self.get_lr()),
                grad_norm=outcome.grad_norm,
                loss_scale=scaler.scale if scaler is not None else None,
                skipped=outcome.skipped,
            )
        )
        return outcome.error
