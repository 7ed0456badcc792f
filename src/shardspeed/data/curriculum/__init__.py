"""Curriculum learning: pure difficulty schedules (``schedule.py``) shared by the legacy seqlen curriculum
(``training/curriculum.py``) and ``data_efficiency``'s difficulty-aware sampler."""

from __future__ import annotations

from shardspeed.data.curriculum.schedule import (
    SCHEDULE_TYPES,
    CurriculumSchedule,
    CurriculumScheduleError,
    schedule_from_config,
    sticky_difficulty,
)

__all__ = [
    "SCHEDULE_TYPES",
    "CurriculumSchedule",
    "CurriculumScheduleError",
    "schedule_from_config",
    "sticky_difficulty",
]
