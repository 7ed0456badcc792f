"""What the training loop announces, and to whom.

The loop drivers (``micro_driver.py``, the pipeline's ``pipe_driver.py``) call ``EngineEvents``; everything that
observes training — wall-clock timers, the rank-0 progress line, monitors (TensorBoard, CSV, W&B), the flops
profiler, the autotuner's measurements — subscribes to it instead of being called from inside the step. A listener
implements any subset of ``EngineListener``'s methods.

[Note: events are observations] A listener must not change what training computes: it runs on every rank, in
registration order, after the step's decisions were made. That is why a report carries the loss as a detached
tensor rather than a float: turning it into a number costs a host synchronisation, which only a listener that
really prints it should pay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["EngineEvents", "EngineListener", "StepReport"]


@dataclass(frozen=True)
class StepReport:
    """One finished optimizer step (taken or skipped for fp16 overflow), as every rank saw it."""

    global_step: int
    """Optimizer steps done, this one included."""
    global_samples: int
    """Samples consumed by the whole data-parallel group, this step included."""
    loss: torch.Tensor | None
    """The last micro-step's loss (detached, unscaled), or None if backward never saw one."""
    lr: tuple[float, ...]
    """Learning rate of each parameter group after the step."""
    grad_norm: float | None
    """Global gradient norm before clipping; None when nothing needed it this step (see ``StepCore``)."""
    loss_scale: float | None
    """fp16's loss scale after the step; None without fp16."""
    skipped: bool
    """True when fp16 overflow skipped the optimizer step."""


class EngineListener(Protocol):
    """Anything that observes training. Every method is optional (``EngineEvents`` checks with ``getattr``)."""

    def on_phase_start(self, phase: str) -> None: ...

    def on_phase_end(self, phase: str) -> None: ...

    def on_step(self, report: StepReport) -> None: ...

    def on_inputs(self, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> None: ...


class EngineEvents:
    """Listeners of one engine, called in subscription order."""

    def __init__(self) -> None:
        self._listeners: list[object] = []

    def subscribe(self, listener: object) -> Callable[[], None]:
        """Add ``listener``; returns a function that removes it again."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``forward``, ``backward``, ``step``, the pipeline's ``reduce`` (its gradient reductions) or ``batch``
        (a whole ``train_batch``) runs inside; listeners hear its start and its end (also when it
        raised, so a timer never stays open)."""
        self._call("on_phase_start", name)
        try:
            yield
        finally:
            self._call("on_phase_end", name)

    def step(self, report: StepReport) -> None:
        self._call("on_step", report)

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward's inputs (the engine's ``forward``, the pipeline's first stage), for listeners that
        read their shape (the monitors' tokens per sample) without a hook on the user's module."""
        if torch.is_grad_enabled():
            self._call("on_inputs", (args, kwargs))

    def _call(self, method: str, arg: object) -> None:
        for listener in self._listeners:
            handler = getattr(listener, method, None)
            if handler is not None:
                handler(arg)
