"""Backward passes as torch runs them: started by ``engine.backward(loss)`` or by autograd itself
(``loss.backward()``, ``engine.scale(loss).backward()``, another engine's loss flowing through this module).

[Note: autograd-started backward] DeepSpeed (since 0.18.3) supports ``loss.backward()``: hooks on the engine's
forward outputs run its backward prologue and divide the outputs' gradients by the gradient accumulation steps,
and a callback queued on autograd's execution engine runs the epilogue (the reduction). The same here:
- start: whichever hook of this engine fires first — a forward output's gradient hook (``watch_outputs``), a
  ZeRO-3 output mark, a parameter's tensor pre-hook — calls ``start_from_autograd``: clearings are swept
  ([Note: gradient markers]), the boundary decision is taken from the micro-step counter (or
  ``set_gradient_accumulation_boundary``), the reducer's ``before_backward`` runs, and ``after_backward`` is
  queued with ``Variable._execution_engine.queue_callback`` on the running graph task;
- nested graph tasks (reentrant activation checkpointing runs an inner backward per block) queue their own
  callback; the pass ends when the last of them has finished;
- 1/GAS: output gradients are divided by ``gradient_accumulation_steps`` unless ``engine.backward`` already
  scaled the loss (DeepSpeed does the same through its output hooks);
- fp16: the loss scale must be applied: ``engine.scale(loss).backward()``; a plain ``loss.backward()`` raises
  DeepSpeed's error ("Loss scaling is required ...");
- errors: a backward that raised never runs its callback; the next ``engine.backward``, ``step`` or
  ``zero_grad`` finds the pass still open outside autograd and aborts it (launched collectives drained).
``engine.backward(loss)`` runs the same prologue itself before autograd and the epilogue after it, so the hooks
find the pass started and do nothing more.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from shardspeed.log import logger

__all__ = ["BackwardPasses"]


def _graph_task() -> int:
    return torch._C._current_graph_task_id()


class BackwardPasses:
    """The open backward pass of one engine (at most one) and how it started and ends."""

    def __init__(
        self,
        *,
        states: Any,
        prologue: Callable[[], None],
        gradient_accumulation_steps: Callable[[], int],
        needs_loss_scale: bool,
        on_forget: Callable[[int], None],
        events: Any = None,
    ) -> None:
        self.states = states
        self._prologue = prologue  # the driver's: boundary decision, host copies, reducer.before_backward
        self._gas = gradient_accumulation_steps  # read at each use: set_train_batch_size() changes it
        self.needs_loss_scale = needs_loss_scale
        self._on_forget = on_forget
        self.open = False
        self.explicit = False  # opened by engine.backward (the loss already carries 1/GAS and the loss scale)
        self._tasks: set[int] = set()  # graph tasks whose end callback is queued
        self.scale_called = False  # engine.scale(loss) since the last autograd-started pass
        self._events = events  # EngineEvents: an autograd-started pass is a "backward" phase too (timers)
        self._phase = contextlib.ExitStack()
        self._warned_unscaled = False

    # --- start ---------------------------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Forget what user code cleared since the engine last wrote the gradients (before a pass, at step)."""
        events = self.states.sweep_cleared()
        if events:
            self._on_forget(events)

    def start_explicit(self) -> None:
        self.abort_stale()
        self.sweep()
        self._prologue()
        self.open, self.explicit = True, True

    def start_from_autograd(self, from_output: bool = False) -> None:
        """A hook of this engine fired in a backward it was not told about (``from_output``: a forward output's)."""
        task = _graph_task()
        if self.open:
            if not self.explicit and task != -1 and task not in self._tasks:
                self._queue_end(task)  # a nested graph task (reentrant checkpointing)
            return
        if self.needs_loss_scale and not self.scale_called:
            raise RuntimeError(
                "Loss scaling is required for this configuration (fp16), but backward() was called directly "
                "without scaling the loss. Use engine.backward(loss) or engine.scale(loss).backward()."
            )
        self.scale_called = False
        if not from_output and self._gas() > 1 and not self._warned_unscaled:
            self._warned_unscaled = True
            logger.warning(
                "a backward reached this engine's parameters without passing its forward outputs (the module was "
                "called directly, not through the engine): its gradients are not divided by "
                "gradient_accumulation_steps=%d (as in DeepSpeed). Call engine(x), or use engine.backward(loss).",
                self._gas(),
            )
        self.sweep()
        if self._events is not None:
            self._phase.enter_context(self._events.phase("backward"))
        try:
            self._prologue()
        except BaseException:
            self._phase.close()
            raise
        self.open, self.explicit = True, False
        self._queue_end(task)

    def _queue_end(self, task: int) -> None:
        self._tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._task_done, task))

    def _task_done(self, task: int) -> None:
        self._tasks.discard(task)
        if not self._tasks and self.open and not self.explicit:
            try:
                self.end()
            except BaseException:
                self.abort()
                raise

    # --- end -----------------------------------------------------------------------------------------------------
    def end(self) -> None:
        self.open = False
        try:
            self.states.reducer.after_backward()
            self.states.mark_grads_clean()
        finally:
            self._phase.close()

    def abort(self) -> None:
        self.open, self.explicit = False, False
        self._tasks.clear()
        try:
            self.states.reducer.abort_backward()
        finally:
            self._phase.close()

    def abort_stale(self) -> bool:
        """Outside autograd a pass still open is one whose backward raised (its end callback never ran)."""
        if self.open and _graph_task() == -1:
            self.abort()
            return True
        return False

    # --- forward outputs -----------------------------------------------------------------------------------------
    def watch_outputs(self, output: Any) -> Any:
        """Hook every floating output that requires grad: starts an unannounced backward, applies 1/GAS."""
        if not torch.is_grad_enabled():
            return output
        for t in _tensors(output):
            if t.requires_grad and t.is_floating_point():
                t.register_hook(self._output_grad)
        return output

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.start_from_autograd(from_output=True)
        gas = self._gas()
        if self.explicit or gas == 1:
            return None
        return grad / gas


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
