"""The legacy seqlen curriculum in the engine (DeepSpeed's ``curriculum_learning`` section).

DeepSpeed's engine keeps a ``CurriculumScheduler`` as ``engine.curriculum_scheduler_legacy``; each training forward
calls ``update_difficulty(global_steps + 1)`` and passes ``curriculum_seqlen=<difficulty>`` to the model, which cuts
its inputs itself (Megatron-DeepSpeed's GPT does). ``SeqlenCurriculum`` is that object here, with DeepSpeed's method
names, built on the pure schedule (``data/curriculum/schedule.py``), plus:

- ``truncate`` (shardspeed's key): the engine cuts the batch instead. Rule: in a tensor of dim >= 2, every dim >= 1
  equal to ``max_difficulty`` (the full sequence length) is cut to ``difficulty`` — ``[b, s]`` tokens become
  ``[b, d]``, ``[b, s, s]`` / ``[b, 1, s, s]`` attention masks ``[b, d, d]`` / ``[b, 1, d, d]`` (Megatron's
  ``[:, :, :d, :d]``) — and made contiguous (Megatron-DeepSpeed's ``.contiguous()``: models may ``.view`` them);
  every other value is passed as is (nested tuples, lists and dicts are walked). ``curriculum_seqlen`` is then not
  passed. When the difficulty is below ``max_difficulty`` and no tensor had a dim of that length, training stops
  with one error naming ``curriculum_learning.max_difficulty`` and the shapes seen (the curriculum would otherwise be
  reported but never applied). Labels the script keeps out of ``engine(...)`` are the script's: *after* the forward,
  cut them with ``truncate_batch(y, engine.curriculum_scheduler_legacy.get_current_difficulty(), full)`` (before
  it, the scheduler still holds the previous step's difficulty).
- the pipeline (``train_batch``): DeepSpeed's pipeline engine cannot pass ``curriculum_seqlen`` to stages, so with
  ``truncate`` the first stage's inputs and the last stage's labels are cut as above; without it the script's data
  iterator shortens the batches (reading ``engine.curriculum_scheduler_legacy.get_current_difficulty()``).
  Either way the activation shapes change, so the channel renegotiates ([Note: curriculum renegotiation]).
- checkpoints: the current difficulty is saved (``state_dict``); the schedule is a pure function of the global step,
  so a resumed run, at any world size, uses the same difficulty at the same step.
- logging: ``Train/Samples/curriculum_seqlen`` in the monitors, and a rank-0 line every ``steps_per_print`` steps.

[Note: curriculum renegotiation] The pipe channel negotiates message shapes once per link and stream (pipe/p2p.py);
a new sequence length must be renegotiated by both sides of every link at the same point. Every stage calls
``pipeline_batch`` at the start of ``train_batch`` and computes the same difficulty (a pure function of the global
step, which every stage counts alike), so every stage resets its channel exactly when the difficulty differs from
the one its channel last negotiated: on the first batch, after a change, and after an ``eval_batch`` (which runs at
the data's own length). DeepSpeed resets when ``get_difficulty(global_steps)`` differs; here the comparison is with
the last *used* length, which also covers a custom schedule and a resumed run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardspeed.config.errors import ConfigError
from shardspeed.data.curriculum import CurriculumSchedule, schedule_from_config, sticky_difficulty
from shardspeed.training.events import StepReport

__all__ = ["CURRICULUM_TAG", "SeqlenCurriculum", "attach_curriculum", "truncate_batch"]

CURRICULUM_TAG = "Train/Samples/curriculum_seqlen"
"""The monitor tag of the current difficulty (x = global samples, like DeepSpeed's other ``Train/Samples`` tags)."""


def truncate_batch(value: Any, seqlen: int, full: int) -> Any:
    """``value`` with every tensor of dim >= 2 cut to ``seqlen`` along each dim >= 1 of length ``full`` (contiguous
    copies); tuples, lists and dicts are walked, anything else is returned as is."""
    return _cut(value, seqlen, full, [])


def _cut(value: Any, seqlen: int, full: int, shapes: list[tuple[tuple[int, ...], bool]]) -> Any:
    """``truncate_batch``, recording each tensor's shape and whether it was cut in ``shapes``."""
    if isinstance(value, torch.Tensor):
        dims = [d for d in range(1, value.dim()) if value.shape[d] == full] if value.dim() >= 2 else []
        shapes.append((tuple(value.shape), bool(dims) and seqlen < full))
        if not dims or seqlen >= full:
            return value
        return value[tuple(slice(0, seqlen) if d in dims else slice(None) for d in range(value.dim()))].contiguous()
    if isinstance(value, tuple):
        items = (_cut(v, seqlen, full, shapes) for v in value)
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_cut(v, seqlen, full, shapes) for v in value]
    if isinstance(value, dict):
        return {k: _cut(v, seqlen, full, shapes) for k, v in value.items()}
    return value


def truncate_checked(value: Any, seqlen: int, full: int) -> Any:
    """``truncate_batch``, raising ``ConfigError`` when ``seqlen < full`` and nothing was cut."""
    shapes: list[tuple[tuple[int, ...], bool]] = []
    out = _cut(value, seqlen, full, shapes)
    if seqlen < full and not any(cut for _, cut in shapes):
        seen = ", ".join(str(list(shape)) for shape, _ in shapes[:8]) or "no tensors"
        raise ConfigError(
            f"curriculum_learning.truncate: the difficulty is {seqlen} but no tensor of the batch has a dim of "
            f"curriculum_learning.max_difficulty = {full} (the full sequence length) to cut; shapes seen: {seen}. "
            "Set max_difficulty to the data's sequence length (dim 1 of the token tensors)"
        )
    return out


class SeqlenCurriculum:
    """``engine.curriculum_scheduler_legacy``: DeepSpeed's ``CurriculumScheduler`` API over a pure schedule."""

    def __init__(
        self,
        schedule: CurriculumSchedule,
        *,
        truncate: bool,
        logger: logging.Logger,
        steps_per_print: int,
        global_rank: int,
        write_events: Callable[[list[tuple[str, float, int]]], None],
    ) -> None:
        self.schedule = schedule
        self.truncate = truncate
        self.current = schedule.min_difficulty
        self.custom_get_difficulty: Callable[[int], int] | None = None
        self.first_step = True  # DeepSpeed's attribute (its pipeline engine reads it)
        self._negotiated: int | None = None  # the length the pipe channel last negotiated ([Note: ...renegotiation])
        self._logger = logger
        self._steps_per_print = steps_per_print
        self._rank = global_rank
        self._write_events = write_events
        if global_rank == 0:
            for warning in schedule.warnings():
                logger.warning("curriculum_learning.%s", warning)

    # --- DeepSpeed's CurriculumScheduler ---------------------------------------------------------------------------
    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The function of the global step a ``schedule_type: custom`` curriculum follows (every rank must set the
        same one: the difficulty is not communicated)."""
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> int:
        return self.schedule.difficulty_at(global_steps, self.custom_get_difficulty)

    def update_difficulty(self, global_steps: int) -> int:
        self.current = sticky_difficulty(self.schedule, self.current, global_steps, self.custom_get_difficulty)
        return self.current

    def get_current_difficulty(self) -> int:
        return self.current

    def set_current_difficulty(self, difficulty: int) -> None:
        self.current = int(difficulty)

    def get_state(self) -> dict[str, Any]:
        return self.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)

    # --- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON for the checkpoint's metadata (piece ``curriculum_legacy``)."""
        return {"current_difficulty": self.current, "schedule_type": self.schedule.schedule_type}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current = int(state["current_difficulty"])
        self._negotiated = None  # a resumed pipeline renegotiates its first batch

    # --- the engine's hooks ----------------------------------------------------------------------------------------
    def before_forward(self, global_steps: int, training: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """DeepSpeed's engine.forward: in training, the difficulty of step ``global_steps + 1`` goes to the model
        (``curriculum_seqlen``), or the batch is cut to it (``truncate``). Evaluation runs at the data's length."""
        if not training:
            return args, kwargs
        seqlen = self.update_difficulty(global_steps + 1)
        if self.truncate:
            cut = truncate_checked((args, kwargs), seqlen, self.schedule.max_difficulty)
            return cut[0], cut[1]
        return args, {**kwargs, "curriculum_seqlen": seqlen}

    def pipeline_batch(self, global_steps: int, iterator: Any, reset_shapes: Callable[[], None]) -> Any:
        """``train_batch``'s start on every stage: update the difficulty, renegotiate the channel when the length
        changed ([Note: curriculum renegotiation]), and with ``truncate`` cut the batches ``iterator`` yields."""
        seqlen = self.update_difficulty(global_steps + 1)
        self.first_step = False
        if seqlen != self._negotiated:
            reset_shapes()
            self._negotiated = seqlen
        if not self.truncate or iterator is None:
            return iterator
        return _Truncating(iterator, seqlen, self.schedule.max_difficulty)

    def pipeline_eval(self, reset_shapes: Callable[[], None]) -> None:
        """``eval_batch``'s start: the evaluation data has its own length; renegotiate now and at the next batch."""
        reset_shapes()
        self._negotiated = None

    # --- EngineListener: logging -----------------------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        self._write_events([(CURRICULUM_TAG, float(self.current), report.global_samples)])
        if self._rank == 0 and report.global_step % self._steps_per_print == 0:
            self._logger.info("step %d: curriculum_seqlen %d", report.global_step, self.current)


class _Truncating:
    """An iterator over ``inner``'s batches, each cut to ``seqlen`` (``truncate_batch``). It reads ``inner`` lazily,
    so the batches not read in this ``train_batch`` stay in ``inner`` for the next one."""

    def __init__(self, inner: Iterator[Any], seqlen: int, full: int) -> None:
        self.inner, self.seqlen, self.full = inner, seqlen, full

    def __iter__(self) -> _Truncating:
        return self

    def __next__(self) -> Any:
        return truncate_checked(next(self.inner), self.seqlen, self.full)


def attach_curriculum(engine: Any) -> SeqlenCurriculum | None:
    """``engine.curriculum_scheduler_legacy`` when ``curriculum_learning`` is enabled (else None), subscribed to the
    engine's events for logging. Called once the engine's monitors exist."""
    section = engine.config.curriculum_learning
    if not section.enabled:
        return None
    monitor = engine.monitor

    def write(events: list[tuple[str, float, int]]) -> None:
        if monitor.enabled:
            monitor.write_events(events)

    curriculum = SeqlenCurriculum(
        schedule_from_config(section),
        truncate=section.truncate,
        logger=engine.logger,
        steps_per_print=engine.config.steps_per_print,
        global_rank=engine.topology.global_rank,
        write_events=write,
    )
    engine.events.subscribe(curriculum)
    return curriculum
