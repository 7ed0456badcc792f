"""The pure curriculum schedules (data/curriculum/schedule.py) equal DeepSpeed's formulas at every step, and their
validation names the offending key."""

from __future__ import annotations

import math

import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.data.curriculum import CurriculumSchedule, CurriculumScheduleError, schedule_from_config
from shardspeed.data.curriculum.schedule import sticky_difficulty


def _root_formula(step: int, lo: int, hi: int, total: int, dstep: int, degree: float) -> int:
    """DeepSpeed 0.19.8 ``__fixed_root_get_difficulty``, written out independently."""
    d = math.floor((step / total) ** (1.0 / degree) * (hi - lo) + lo)
    d = d - d % dstep
    d = max(d, math.ceil(lo / dstep) * dstep)
    return min(d, hi)


ROOT_CASES = [
    # (lo, hi, total, difficulty_step, degree)
    (8, 1024, 100, 8, 1.0),
    (8, 1024, 100, 8, 2.0),
    (8, 1024, 37, 8, 3.0),
    (8, 64, 10, 16, 1.0),  # min not a multiple of the step: floor raised to 16, never 0
    (5, 33, 13, 4, 2.0),
    (64, 64, 5, 8, 1.0),  # min == max
    (1, 7, 3, 1, 0.5),  # root_degree < 1 (a power): DeepSpeed takes any positive degree
]


@pytest.mark.parametrize(("lo", "hi", "total", "dstep", "degree"), ROOT_CASES)
def test_fixed_root_and_linear_equal_the_formula_at_every_step(lo, hi, total, dstep, degree) -> None:
    root = CurriculumSchedule(lo, hi, "fixed_root", total, dstep, degree)
    linear = CurriculumSchedule(lo, hi, "fixed_linear", total, dstep)
    for step in range(0, total + 5):
        assert root.difficulty_at(step) == _root_formula(step, lo, hi, total, dstep, degree), step
        assert linear.difficulty_at(step) == _root_formula(step, lo, hi, total, dstep, 1.0), step
        assert root.difficulty_at(step) % dstep == 0 or root.difficulty_at(step) == hi
    assert linear.difficulty_at(total) == max(hi - hi % dstep, math.ceil(lo / dstep) * dstep) or hi < dstep


def test_known_values() -> None:
    """Hand-computed points (the DeepSpeed tutorial's seqlen curriculum, shortened)."""
    s = CurriculumSchedule(8, 1024, "fixed_linear", 100, 8)
    assert [s.difficulty_at(k) for k in (0, 1, 2, 50, 99, 100, 101)] == [8, 16, 24, 512, 1008, 1024, 1024]
    r = CurriculumSchedule(8, 1024, "fixed_root", 100, 8, 2)
    # sqrt(25/100) * 1016 + 8 = 516 -> 512 (multiple of 8)
    assert r.difficulty_at(25) == 512
    assert CurriculumSchedule(8, 64, "fixed_linear", 10, 16).difficulty_at(0) == 16


def test_fixed_discrete_at_every_step() -> None:
    s = CurriculumSchedule(1, 3, "fixed_discrete", difficulty=(1, 2, 3), max_step=(5, 10))
    want = [1] * 6 + [2] * 5 + [3] * 10  # steps 0..5 -> 1, 6..10 -> 2, then 3
    assert [s.difficulty_at(k) for k in range(21)] == want


def test_custom_needs_a_function_returning_int() -> None:
    s = CurriculumSchedule(8, 64, "custom")
    assert s.difficulty_at(7, custom=lambda step: 8 * (step + 1)) == 64
    with pytest.raises(CurriculumScheduleError, match="set_custom_curriculum_learning_schedule"):
        s.difficulty_at(0)
    with pytest.raises(CurriculumScheduleError, match="must return an int"):
        s.difficulty_at(0, custom=lambda step: 8.5)


def test_sticky_difficulty_stops_at_max_like_deepspeed() -> None:
    """DeepSpeed's update_difficulty stops following the schedule once max_difficulty is reached."""
    s = CurriculumSchedule(1, 3, "custom")
    down = {0: 1, 1: 3, 2: 1}.__getitem__
    current = s.min_difficulty
    seen = []
    for step in range(3):
        current = sticky_difficulty(s, current, step, down)
        seen.append(current)
    assert seen == [1, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"schedule_type": "fixed_linear", "difficulty_step": 8}, "schedule_config.total_curriculum_step"),
        ({"schedule_type": "fixed_linear", "total_curriculum_step": 10}, "schedule_config.difficulty_step"),
        (
            {"schedule_type": "fixed_root", "total_curriculum_step": 10, "difficulty_step": 8},
            "schedule_config.root_degree",
        ),
        ({"schedule_type": "fixed_discrete", "max_step": (3,)}, "schedule_config.difficulty"),
        ({"schedule_type": "fixed_discrete", "difficulty": (8, 16)}, "schedule_config.max_step"),
        ({"schedule_type": "fixed_discrete", "difficulty": (8, 16), "max_step": (3, 4)}, "schedule_config.difficulty"),
        (
            {"schedule_type": "fixed_discrete", "difficulty": (8, 16, 32), "max_step": (4, 4)},
            "schedule_config.max_step",
        ),
        (
            {"schedule_type": "fixed_linear", "total_curriculum_step": 0, "difficulty_step": 8},
            "schedule_config.total_curriculum_step",
        ),
        ({"schedule_type": "sqrt"}, "schedule_type"),
        ({"schedule_type": "custom", "min_difficulty": 9}, "min_difficulty"),
    ],
)
def test_bad_schedules_name_the_key(kwargs, key) -> None:
    args = {"min_difficulty": 8, "max_difficulty": 8, **kwargs}
    with pytest.raises(CurriculumScheduleError) as info:
        CurriculumSchedule(**args)
    assert info.value.key == key


BASE = {"train_micro_batch_size_per_gpu": 1}


def _cl(**section) -> dict:
    return {**BASE, "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **section}}


def test_config_section_builds_the_schedule() -> None:
    cfg = load_config(
        dp_world_size=1,
        config=_cl(
            min_difficulty=8,
            max_difficulty=64,
            schedule_type="fixed_root",
            schedule_config={"total_curriculum_step": 10, "difficulty_step": 8, "root_degree": 2},
        ),
    )
    s = schedule_from_config(cfg.curriculum_learning)
    assert s == CurriculumSchedule(8, 64, "fixed_root", 10, 8, 2.0)
    disc = load_config(
        dp_world_size=1,
        config=_cl(
            min_difficulty=1,
            max_difficulty=3,
            schedule_type="fixed_discrete",
            schedule_config={"difficulty": [1, 2, 3], "max_step": [5, 10]},
        ),
    )
    assert schedule_from_config(disc.curriculum_learning).difficulty == (1, 2, 3)
    # off: no schedule keys needed
    assert not load_config(
        dp_world_size=1, config={**BASE, "curriculum_learning": {"enabled": False}}
    ).curriculum_learning.enabled


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"max_difficulty": 64, "schedule_type": "fixed_linear"}, "curriculum_learning.min_difficulty: required"),
        (
            {
                "min_difficulty": 8,
                "max_difficulty": 64,
                "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": 10},
            },
            "curriculum_learning.schedule_config.difficulty_step",
        ),
        (
            {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "custom", "curriculum_type": "vocab"},
            "curriculum_learning.curriculum_type\" = 'vocab' is not supported",
        ),
        ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "exp"}, "curriculum_learning.schedule_type"),
        (
            {
                "min_difficulty": 8,
                "max_difficulty": 64,
                "schedule_type": "custom",
                "schedule_config": {"root_degre": 2},
            },
            "root_degree",
        ),
    ],
)
def test_config_errors_name_the_key(section, needle) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(dp_world_size=1, config=_cl(**section))
    assert needle in str(info.value), str(info.value)
