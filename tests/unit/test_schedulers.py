"""DeepSpeed's LR schedules: curves against their formulas, the step-index convention, state, errors.

Expected values are written out here from DeepSpeed's documented formulas (plain math), never taken from
the code under test. Index convention: ``step`` is ``last_batch_iteration`` (-1 at construction).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from shardspeed.config.errors import ConfigError
from shardspeed.schedulers import (
    CycleShape,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    lr_range_test_lr_at,
    one_cycle_lr_at,
    one_cycle_momentum_at,
    validate_scheduler_params,
    warmup_cosine_ratio_at,
    warmup_decay_lr_at,
    warmup_lr_at,
)


def _adam(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups)


def _sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def _lr_after(scheduler: object, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """The lr in the optimizer after ``steps`` calls of scheduler.step() (index = steps - 1)."""
    for _ in range(steps):
        scheduler.step()  # type: ignore[attr-defined]
    return _lrs(optimizer)


# ---------------------------------------------------------------- WarmupLR / WarmupDecayLR curves


@pytest.mark.parametrize("step", [-1, 0, 1, 4, 9, 10, 50])
def test_warmup_log_curve(step: int) -> None:
    low, high, n = 0.001, 0.1, 10
    expected = low if step < 0 else (high if step >= n else low + (high - low) * math.log(step + 1) / math.log(n))
    assert warmup_lr_at(step, low, high, n, "log") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step", [-1, 0, 3, 9, 10, 11])
def test_warmup_linear_curve(step: int) -> None:
    low, high, n = 0.0, 0.2, 10
    expected = {-1: 0.0, 0: 0.0, 3: 0.06, 9: 0.18, 10: 0.2, 11: 0.2}[step]
    assert warmup_lr_at(step, low, high, n, "linear") == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_num_steps_is_floored_at_two_like_deepspeed() -> None:
    # DeepSpeed uses max(2, warmup_num_steps): with 1 warmup step the lr is halfway at index 1.
    assert warmup_lr_at(1, 0.0, 1.0, 1, "linear") == pytest.approx(0.5)
    assert warmup_lr_at(2, 0.0, 1.0, 1, "linear") == 1.0
    assert warmup_lr_at(1, 0.0, 1.0, 1, "log") == pytest.approx(1.0)  # log(2)/log(2)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (-1, 0.01),
        (0, 0.01),
        (5, 0.01 + 0.09 * 5 / 10),  # linear warmup
        (10, 0.1),  # warmup done: (total - 10) / (total - 10) = 1
        (35, 0.01 + 0.09 * (60 - 35) / 50),
        (60, 0.01),  # back at warmup_min_lr, not 0
        (80, 0.01),
    ],
)
def test_warmup_decay_curve(step: int, expected: float) -> None:
    lr = warmup_decay_lr_at(
        step,
        total_num_steps=60,
        warmup_min_lr=0.01,
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="linear",
    )
    assert lr == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_class_follows_the_curve_and_starts_at_min() -> None:
    optimizer = _adam(0.5)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5)
    assert _lrs(optimizer) == [0.01]  # written at construction (index -1)
    assert scheduler.get_last_lr() == [0.01]
    expected = [0.01 + 0.09 * math.log(k + 1) / math.log(5) for k in range(5)] + [0.1, 0.1]
    for k, want in enumerate(expected):
        scheduler.step()
        assert scheduler.last_batch_iteration == k
        assert _lrs(optimizer) == [pytest.approx(want, rel=1e-12)]
        assert scheduler.get_last_lr() == scheduler.get_lr() == _lrs(optimizer)


def test_warmup_max_lr_defaults_to_each_groups_own_lr() -> None:
    optimizer = _adam(0.1, 0.02)
    WarmupLR(optimizer, warmup_num_steps=4, warmup_type="linear")
    assert _lrs(optimizer) == [0.0, 0.0]
    optimizer = _adam(0.1, 0.02)
    scheduler = WarmupDecayLR(optimizer, total_num_steps=10, warmup_num_steps=4, warmup_type="linear")
    assert _lr_after(scheduler, optimizer, 3) == pytest.approx([0.1 * 2 / 4, 0.02 * 2 / 4])  # index 2
    # Index 5 is past the warmup: decay fraction (10 - 5) / (10 - 4), back towards warmup_min_lr = 0.
    assert _lr_after(scheduler, optimizer, 3) == pytest.approx([0.1 * 5 / 6, 0.02 * 5 / 6])


def test_warmup_per_group_lists() -> None:
    optimizer = _adam(1.0, 1.0)
    scheduler = WarmupLR(
        optimizer,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.2],
        warmup_num_steps=10,
        warmup_type="linear",
    )
    assert _lr_after(scheduler, optimizer, 6) == pytest.approx([0.5, 0.15])
    with pytest.raises(ConfigError, match=r"warmup_min_lr has 3 values but the optimizer has 2 param groups"):
        WarmupLR(optimizer, warmup_min_lr=[0.0, 0.1, 0.2])


# ---------------------------------------------------------------- WarmupCosineLR


def _cosine_expected(step: int, total: int, wmin: float, n: int, cmin: float) -> float:
    if step < 0:
        return 0.0
    if step < n:
        return wmin + (1 - wmin) * step / n  # linear warmup in these tests
    progress = min(1.0, (step - n + 1) / (total - n))
    return cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("step", [-1, 0, 2, 4, 5, 10, 24, 25, 40])
def test_warmup_cosine_ratio(step: int) -> None:
    got = warmup_cosine_ratio_at(
        step,
        total_num_steps=25,
        warmup_min_ratio=0.1,
        warmup_num_steps=5,
        cos_min_ratio=0.05,
        warmup_type="linear",
    )
    assert got == pytest.approx(_cosine_expected(step, 25, 0.1, 5, 0.05), rel=1e-12, abs=1e-15)


def test_warmup_cosine_ends_at_cos_min_ratio() -> None:
    assert warmup_cosine_ratio_at(25, 25, 0.0, 5, 0.05, "log") == pytest.approx(0.05)
    assert warmup_cosine_ratio_at(1000, 25, 0.0, 5, 0.05, "log") == pytest.approx(0.05)
    assert warmup_cosine_ratio_at(3, 25, 0.0, 5, 0.05, "log") == pytest.approx(math.log(4) / math.log(5))


def test_warmup_cosine_scales_each_groups_base_lr() -> None:
    optimizer = _adam(0.1, 0.01)
    scheduler = WarmupCosineLR(
        optimizer,
        total_num_steps=25,
        warmup_min_ratio=0.1,
        warmup_num_steps=5,
        cos_min_ratio=0.05,
        warmup_type="linear",
    )
    assert _lrs(optimizer) == [0.0, 0.0]  # DeepSpeed: ratio 0 before the first step()
    for steps in (1, 3, 5, 10):
        ratio = _cosine_expected(steps - 1, 25, 0.1, 5, 0.05)
        scheduler.step(steps - 1)
        assert _lrs(optimizer) == pytest.approx([0.1 * ratio, 0.01 * ratio], rel=1e-12)


# ---------------------------------------------------------------- OneCycle


def test_one_cycle_triangle_then_decay() -> None:
    shape = CycleShape(first_step_size=4, second_step_size=6, decay_step_size=5)

    def expected(step: int) -> float:
        pos = step + 1  # DeepSpeed counts the cycle position from step + 1
        if step < 10:
            pos %= 10
            scale = pos / 4 if pos <= 4 else (10 - pos) / 6
            return 0.1 + 0.9 * scale
        return 0.1 / (1 + 0.5 * (step - 10 + 1) / 5)

    for step in [-1, 0, 1, 3, 4, 6, 8, 9, 10, 14, 30]:
        got = one_cycle_lr_at(step, 0.1, 1.0, shape, decay_lr_rate=0.5)
        assert got == pytest.approx(expected(step), rel=1e-12), step
    assert one_cycle_lr_at(3, 0.1, 1.0, shape) == pytest.approx(1.0)  # the peak, at index first - 1
    no_decay = CycleShape(4, 6, decay_step_size=0)
    assert one_cycle_lr_at(30, 0.1, 1.0, no_decay, decay_lr_rate=0.5) == 0.1


def test_one_cycle_staircase() -> None:
    shape = CycleShape(first_step_size=6, second_step_size=4, first_stair_count=3, second_stair_count=2)
    # Rising half: 3 stairs over 6 steps -> scale floor(pos / 2) / 3; falling: 2 stairs over 4 steps.
    expected_scales = {-1: 0.0, 0: 0.0, 1: 1 / 3, 2: 1 / 3, 3: 2 / 3, 5: 1.0, 6: 0.5, 7: 0.5, 8: 0.0, 9: 0.0}
    for step, scale in expected_scales.items():
        assert one_cycle_lr_at(step, 0.0, 3.0, shape) == pytest.approx(3.0 * scale, abs=1e-15), step


def test_one_cycle_momentum_moves_against_lr() -> None:
    shape = CycleShape(4, 4, decay_step_size=2)
    assert one_cycle_momentum_at(-1, 0.8, 0.9, shape) == pytest.approx(0.9)
    assert one_cycle_momentum_at(1, 0.8, 0.9, shape) == pytest.approx(0.9 - 0.1 * 2 / 4)  # position 2 of 4
    assert one_cycle_momentum_at(3, 0.8, 0.9, shape) == pytest.approx(0.8)
    assert one_cycle_momentum_at(9, 0.8, 0.9, shape, decay_mom_rate=0.1) == pytest.approx(0.9 * (1 + 0.1 * 1))


def test_one_cycle_class_drives_lr_and_beta1_and_keeps_beta2() -> None:
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=5.0, betas=(0.5, 0.98))
    scheduler = OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
    assert _lrs(optimizer) == [0.1]
    assert optimizer.param_groups[0]["betas"] == (pytest.approx(0.9), 0.98)
    scheduler.step()  # index 0 -> position 1 of 2: halfway up
    assert _lrs(optimizer) == pytest.approx([0.55])
    assert optimizer.param_groups[0]["betas"] == (pytest.approx(0.85), 0.98)
    scheduler.step()  # index 1 -> the peak
    assert _lrs(optimizer) == pytest.approx([1.0])
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.8)


def test_one_cycle_without_betas_warns_and_leaves_momentum(caplog: pytest.LogCaptureFixture) -> None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.7)
    with caplog.at_level(logging.WARNING):
        scheduler = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3)
    assert "cycle_momentum is disabled" in caplog.text
    assert not scheduler.cycle_momentum
    scheduler.step()
    assert optimizer.param_groups[0]["momentum"] == 0.7


# ---------------------------------------------------------------- LRRangeTest


@pytest.mark.parametrize("step", [-1, 0, 4, 9, 10, 25])
def test_lr_range_test_curves(step: int) -> None:
    continuous = 0.01 * (1 + 0.5 * (step + 1) / 10)
    stairs = 0.01 * (1 + 0.5 * math.floor((step + 1) / 10))
    assert lr_range_test_lr_at(step, 0.01, 10, 0.5, False) == pytest.approx(continuous, rel=1e-12)
    assert lr_range_test_lr_at(step, 0.01, 10, 0.5, True) == pytest.approx(stairs, rel=1e-12)


def test_lr_range_test_class() -> None:
    optimizer = _adam(1.0)
    scheduler = LRRangeTest(optimizer, lr_range_test_min_lr=0.01, lr_range_test_step_size=10)
    assert _lrs(optimizer) == [0.01]
    assert _lr_after(scheduler, optimizer, 20) == pytest.approx([0.01 * (1 + 20 / 10)])


# ---------------------------------------------------------------- state, jumps, tensor lrs


@pytest.mark.parametrize(
    ("type_name", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 8}),
        ("WarmupDecayLR", {"warmup_num_steps": 4, "total_num_steps": 20, "warmup_max_lr": 0.05}),
        ("WarmupCosineLR", {"warmup_num_steps": 4, "total_num_steps": 20}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5}),
        ("LRRangeTest", {"lr_range_test_step_size": 3}),
    ],
)
def test_state_dict_round_trip(type_name: str, params: dict) -> None:
    optimizer_a = _adam(0.1, 0.03)
    scheduler_a = build_scheduler(type_name, params, optimizer_a)
    for _ in range(7):
        scheduler_a.step()
    state = scheduler_a.state_dict()
    assert state["last_batch_iteration"] == 6

    # Resume: a fresh optimizer whose lr was already restored mid-schedule (so "its own lr" is wrong),
    # then the scheduler state.
    optimizer_b = _adam(*_lrs(optimizer_a))
    scheduler_b = build_scheduler(type_name, params, optimizer_b)
    scheduler_b.load_state_dict(state)
    assert _lrs(optimizer_b) == pytest.approx(_lrs(optimizer_a), rel=1e-12)
    for _ in range(5):
        scheduler_a.step()
        scheduler_b.step()
        assert _lrs(optimizer_b) == pytest.approx(_lrs(optimizer_a), rel=1e-12)
    assert optimizer_b.param_groups[0]["betas"] == optimizer_a.param_groups[0]["betas"]


def test_loads_a_deepspeed_style_state_dict() -> None:
    optimizer = _adam(1.0)
    scheduler = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    scheduler.load_state_dict({"last_batch_iteration": 4})
    assert _lrs(optimizer) == pytest.approx([0.4])
    scheduler.step()
    assert _lrs(optimizer) == pytest.approx([0.5])


def test_step_with_explicit_index_and_resume_index() -> None:
    optimizer = _adam(1.0)
    scheduler = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    scheduler.step(7)
    assert _lrs(optimizer) == pytest.approx([0.7])
    resumed = WarmupLR(_adam(1.0), warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=3)
    assert resumed.get_last_lr() == pytest.approx([0.3])


def test_tensor_lr_is_updated_in_place() -> None:
    lr = torch.tensor(0.5)
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    scheduler.step(2)
    assert optimizer.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(0.2)


# ---------------------------------------------------------------- build_scheduler and validation


def test_build_scheduler_sources() -> None:
    optimizer = _sgd()
    assert build_scheduler(None, None, optimizer) is None
    mine = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert build_scheduler(None, None, optimizer, user_scheduler=mine) is mine
    built = build_scheduler(None, None, optimizer, user_scheduler=lambda opt: WarmupLR(opt, warmup_num_steps=3))
    assert isinstance(built, WarmupLR) and built.optimizer is optimizer
    assert isinstance(build_scheduler("warmuplr", {}, optimizer), WarmupLR)
    assert build_scheduler("WarmupLR", {}, optimizer, user_scheduler=mine) is mine  # the client's wins (DeepSpeed)
    with pytest.raises(TypeError, match="no step"):
        build_scheduler(None, None, optimizer, user_scheduler=lambda opt: 42)


def test_validate_fills_deepspeed_defaults_and_is_idempotent() -> None:
    normalized = validate_scheduler_params("WarmupLR", {})
    assert normalized == {
        "warmup_min_lr": 0.0,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    cosine = validate_scheduler_params("WarmupCosineLR", {"total_num_steps": 100})
    assert cosine["warmup_min_ratio"] == 0.0 and cosine["cos_min_ratio"] == 0.0001
    one_cycle = validate_scheduler_params("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1})
    assert one_cycle["cycle_first_step_size"] == 2000 and one_cycle["cycle_momentum"] is True
    assert one_cycle["cycle_min_mom"] == 0.8 and one_cycle["cycle_max_mom"] == 0.9
    range_test = validate_scheduler_params("LRRangeTest", {"lr_range_test_step_size": 1e3})
    assert range_test["lr_range_test_step_size"] == 1000 and range_test["lr_range_test_min_lr"] == 0.001
    for name, params in [("WarmupLR", normalized), ("OneCycle", one_cycle), ("WarmupCosineLR", cosine)]:
        assert validate_scheduler_params(name, params) == params


@pytest.mark.parametrize(
    ("type_name", "params", "pattern"),
    [
        ("WarmupLr", {}, None),  # case-insensitive: accepted
        (
            "Warmup",
            {},
            r"scheduler\.type 'Warmup' is not a known LR schedule \(did you mean \"WarmupLR\"\?\)",
        ),
        ("CosineLR", {}, r"scheduler\.type 'CosineLR'.*valid types: WarmupLR"),
        (
            "WarmupLR",
            {"warmup_num_step": 3},
            r'scheduler\.params\.warmup_num_step .*did you mean "warmup_num_steps"',
        ),
        (
            "WarmupLR",
            {"warmup_num_steps": 0},
            r"scheduler\.params\.warmup_num_steps must be an integer >= 1, got 0",
        ),
        ("WarmupLR", {"warmup_num_steps": -5}, r"warmup_num_steps must be an integer >= 1, got -5"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, r"warmup_num_steps must be an integer, got 2\.5"),
        (
            "WarmupLR",
            {"warmup_type": "cosine"},
            r'scheduler\.params\.warmup_type must be one of "log", "linear"',
        ),
        ("WarmupLR", {"warmup_min_lr": -0.1}, r"scheduler\.params\.warmup_min_lr must be >= 0"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, r"warmup_max_lr must be a number.*Hugging Face"),
        ("WarmupDecayLR", {}, r"scheduler\.params\.total_num_steps is required"),
        ("WarmupDecayLR", {"total_num_steps": -1}, r"total_num_steps must be an integer >= 1"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 10, "cos_min_ratio": 1.5},
            r"cos_min_ratio must be >= 0\.0 and <= 1\.0",
        ),
        ("OneCycle", {"cycle_max_lr": 1.0}, r"scheduler\.params\.cycle_min_lr is required"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_stair_count": -1}, r"stair_count"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": "true"}, r"true or false"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, r"lr_range_test_step_size must be an integer >= 1"),
        ("LRRangeTest", {"last_batch_iteration": -2}, r"last_batch_iteration must be an integer >= -1"),
    ],
)
def test_validation_errors_name_the_culprit(type_name: str, params: dict, pattern: str | None) -> None:
    if pattern is None:
        validate_scheduler_params(type_name, params)
        return
    with pytest.raises(ConfigError, match=pattern):
        validate_scheduler_params(type_name, params)


def test_total_below_warmup_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        build_scheduler("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 100}, _sgd())
    assert "total_num_steps (10) is less than warmup_num_steps (100)" in caplog.text


def test_validation_uses_the_given_path() -> None:
    with pytest.raises(ConfigError, match=r"my\.sched\.params\.warmup_type"):
        validate_scheduler_params("WarmupLR", {"warmup_type": "x"}, path="my.sched.params")
