from __future__ import annotations

from shardspeed.precision.grad_norm import clip_coefficient
from shardspeed.precision.loss_scaler import LossScaler


def test_dynamic_scale_hysteresis_then_halve_then_grow() -> None:
    s = LossScaler(dynamic=True, init_scale=2.0**16, window=3, hysteresis=2, min_scale=1.0)
    assert "kept" in s.update(overflow=True) and s.scale == 2.0**16  # hysteresis absorbs the first overflow
    assert "->" in s.update(overflow=True) and s.scale == 2.0**15
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 2.0**15
    s.update(overflow=False)  # third clean step in a row → double
    assert s.scale == 2.0**16
    assert s.state.skipped_steps == 2


def test_min_scale_and_state_round_trip() -> None:
    s = LossScaler(dynamic=True, init_scale=2.0, hysteresis=1, min_scale=1.0)
    s.update(overflow=True)
    s.update(overflow=True)
    assert s.scale == 1.0
    t = LossScaler(dynamic=True, init_scale=8.0)
    t.load_state_dict(s.state_dict())
    assert t.scale == 1.0 and t.state.skipped_steps == 2


def test_consecutive_hysteresis_refills_after_clean_step() -> None:
    s = LossScaler(dynamic=True, init_scale=4.0, window=100, hysteresis=2, consecutive_hysteresis=True)
    s.update(overflow=True)
    s.update(overflow=False)
    s.update(overflow=True)  # budget refilled → kept again
    assert s.scale == 4.0


def test_static_scale_never_changes() -> None:
    s = LossScaler(dynamic=False, init_scale=128.0)
    s.update(overflow=True)
    s.update(overflow=False)
    assert s.scale == 128.0


def test_clip_coefficient_matches_torch_formula() -> None:
    assert clip_coefficient(10.0, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert abs(clip_coefficient(4.0, 1.0) - 1.0 / (4.0 + 1e-6)) < 1e-12
