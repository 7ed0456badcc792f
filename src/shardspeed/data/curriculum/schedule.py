"""Curriculum difficulty schedules: DeepSpeed's ``CurriculumScheduler`` math as pure functions of the global step.

One schedule maps an optimizer step to a difficulty (a sequence length for the legacy ``curriculum_learning``
section, a metric value or percentile for ``data_efficiency``'s metrics). The formulas are DeepSpeed 0.19.8's
(``runtime/data_pipeline/curriculum_scheduler.py``), kept exactly, including its rounding:

- ``fixed_linear``: ``fixed_root`` with ``root_degree`` 1.
- ``fixed_root``: ``d = floor((step / total_curriculum_step) ** (1 / root_degree) * (max - min) + min)``, then floored
  to a multiple of ``difficulty_step``, raised to the first multiple of ``difficulty_step`` at or above ``min`` (so a
  first step never yields length 0) and capped at ``max``.
- ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``step <= max_step[i]``; past the last ``max_step``
  the last difficulty.
- ``custom``: a user function of the step (DeepSpeed's ``set_custom_get_difficulty``).

[Note: a schedule is stateless] ``difficulty_at`` depends on the step alone, so every rank and every pipeline stage
computes the same value with no communication, and a resumed run, at any world size, gets the same difficulty for the
same global step. DeepSpeed's one piece of state (its ``update_difficulty`` stops updating once the difficulty reached
``max_difficulty``) lives in ``sticky_difficulty`` below, a pure function of the previous difficulty and the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "SCHEDULE_TYPES",
    "CurriculumSchedule",
    "CurriculumScheduleError",
    "ScheduleSection",
    "schedule_from_config",
    "sticky_difficulty",
]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")

TENSOR_CORE_MULTIPLE = 8
"""DeepSpeed warns when ``difficulty_step`` is not a multiple of this (FP16 tensor cores; 16 for INT8)."""


class CurriculumScheduleError(ValueError):
    """A schedule that cannot be evaluated: ``key`` names the offending ``schedule_config`` key (or the schedule's
    own key, e.g. ``schedule_type``), relative to the section the schedule came from."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class CurriculumSchedule:
    """One difficulty schedule (DeepSpeed's ``CurriculumScheduler`` without its mutable state).

    Construction validates with DeepSpeed's rules (its asserts, as :class:`CurriculumScheduleError` naming the key)
    plus the ones its formulas need to make sense (``min <= max``, positive steps, ascending ``max_step``).
    """

    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    total_curriculum_step: int | None = None
    difficulty_step: int | None = None
    root_degree: float | None = None
    difficulty: tuple[int, ...] = ()
    max_step: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for problem in schedule_problems(self):
            raise CurriculumScheduleError(*problem)

    def difficulty_at(self, global_step: int, custom: Callable[[int], int] | None = None) -> int:
        """The difficulty DeepSpeed's ``get_difficulty(global_step)`` returns. ``custom`` is the user's function for
        ``schedule_type: custom`` (required there, unused otherwise)."""
        if self.schedule_type == "fixed_discrete":
            return _fixed_discrete(self.difficulty, self.max_step, global_step)
        if self.schedule_type == "fixed_linear":
            return self._fixed_root(global_step, 1.0)
        if self.schedule_type == "fixed_root":
            assert self.root_degree is not None  # validated in __post_init__
            return self._fixed_root(global_step, self.root_degree)
        if custom is None:
            raise CurriculumScheduleError(
                "schedule_type",
                '"custom" needs a schedule function (global step -> difficulty) before the first training step: '
                "engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn) for curriculum_learning, "
                "engine.set_custom_curriculum_learning_schedule({metric: fn}) for data_efficiency",
            )
        value = custom(global_step)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CurriculumScheduleError(
                "schedule_type",
                f"the custom schedule function returned {value!r} at step {global_step}; it must return an int",
            )
        return value

    def warnings(self) -> list[str]:
        """DeepSpeed's one warning: a ``difficulty_step`` that tensor cores cannot use."""
        if self.difficulty_step is not None and self.difficulty_step % TENSOR_CORE_MULTIPLE:
            return [
                f"schedule_config.difficulty_step = {self.difficulty_step} is not a multiple of 8: with the seqlen "
                "metric, NVIDIA tensor cores need multiples of 8 (FP16) or 16 (INT8); ignore this for other "
                "metrics or hardware (DeepSpeed's warning)"
            ]
        return []

    def _fixed_root(self, global_step: int, root_degree: float) -> int:
        assert self.total_curriculum_step is not None and self.difficulty_step is not None
        lo, hi, step = self.min_difficulty, self.max_difficulty, self.difficulty_step
        fraction = (float(global_step) / self.total_curriculum_step) ** (1.0 / root_degree)
        value = math.floor(fraction * (hi - lo) + lo)
        value -= value % step
        # DeepSpeed 0.19.8: flooring to a multiple of the step can fall below min (min 8, step 16 -> 0, an empty
        # sequence); it raises the floor to the first multiple of the step at or above min, then caps at max.
        value = max(value, -(-lo // step) * step)
        return min(value, hi)


def _fixed_discrete(difficulty: Sequence[int], max_step: Sequence[int], global_step: int) -> int:
    for level, last_step in zip(difficulty, max_step, strict=False):
        if global_step <= last_step:
            return level
    return difficulty[-1]


def sticky_difficulty(schedule: CurriculumSchedule, current: int, global_step: int, custom=None) -> int:
    """DeepSpeed's ``update_difficulty``: the next difficulty given the current one. Once the current difficulty
    reached ``max_difficulty`` it stays there (a custom or discrete schedule that later goes down is not followed)."""
    if current < schedule.max_difficulty:
        return schedule.difficulty_at(global_step, custom)
    return current


def schedule_problems(s: CurriculumSchedule) -> list[tuple[str, str]]:
    """(key, problem) for each rule the schedule breaks; empty when it is usable."""
    cfg = "schedule_config."
    if s.schedule_type not in SCHEDULE_TYPES:
        return [("schedule_type", f"unknown schedule type {s.schedule_type!r}; expected one of {SCHEDULE_TYPES}")]
    if s.min_difficulty > s.max_difficulty:
        return [("min_difficulty", f"{s.min_difficulty} is above max_difficulty ({s.max_difficulty})")]
    if s.schedule_type in ("fixed_linear", "fixed_root"):
        needed = ["total_curriculum_step", "difficulty_step"] + (
            ["root_degree"] if s.schedule_type == "fixed_root" else []
        )
        for key in needed:
            if getattr(s, key) is None:
                return [(cfg + key, f'required by schedule_type "{s.schedule_type}"')]
        for key in needed:
            if getattr(s, key) <= 0:
                return [(cfg + key, f"must be positive, got {getattr(s, key)}")]
    if s.schedule_type == "fixed_discrete":
        if not s.difficulty:
            return [(cfg + "difficulty", 'required (a non-empty list) by schedule_type "fixed_discrete"')]
        if not s.max_step:
            return [(cfg + "max_step", 'required (a non-empty list) by schedule_type "fixed_discrete"')]
        if len(s.difficulty) != len(s.max_step) + 1:
            return [
                (
                    cfg + "difficulty",
                    f"has {len(s.difficulty)} entries; it needs exactly one more than max_step ({len(s.max_step)}): "
                    "the last difficulty holds after the last max_step",
                )
            ]
        if any(b <= a for a, b in zip(s.max_step, s.max_step[1:], strict=False)):
            return [(cfg + "max_step", f"must be strictly increasing, got {list(s.max_step)}")]
    return []


class ScheduleSection(Protocol):
    """What :func:`schedule_from_config` reads: ``config.curriculum.CurriculumScheduleConfig`` or a section
    extending it (``data_efficiency``'s per-metric sections)."""

    min_difficulty: int | None
    max_difficulty: int | None
    schedule_type: str | None

    @property
    def schedule_config(self) -> Any: ...  # a config.curriculum.ScheduleParamsConfig


def schedule_from_config(section: ScheduleSection) -> CurriculumSchedule:
    """The schedule a validated config section describes (raises :class:`CurriculumScheduleError` otherwise)."""
    for key in ("min_difficulty", "max_difficulty", "schedule_type"):
        if getattr(section, key) is None:
            raise CurriculumScheduleError(key, "required when curriculum learning is enabled")
    params = section.schedule_config
    return CurriculumSchedule(
        min_difficulty=section.min_difficulty,
        max_difficulty=section.max_difficulty,
        schedule_type=section.schedule_type,
        total_curriculum_step=params.total_curriculum_step,
        difficulty_step=params.difficulty_step,
        root_degree=params.root_degree,
        difficulty=tuple(params.difficulty or ()),
        max_step=tuple(params.max_step or ()),
    )
