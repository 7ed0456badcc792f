"""The two-point profile's pure parts (autotuning/profile_run.py, [Note: two-point profile])."""

from __future__ import annotations

import pytest

from shardspeed.autotuning.profile_run import second_micro_batch, two_point_correction


def test_second_micro_batch_uses_half_the_room_the_states_leave() -> None:
    # 100 MB budget, 20 MB of states: 40 MB for the profile's activations, 3 MB a sample -> 8 (16 would be 48 MB)
    assert second_micro_batch(3e6, 20e6, int(100e6), 1024) == 8
    assert second_micro_batch(3e6, 20e6, None, 1024) == 32  # no budget: the cap keeps the profile short
    assert second_micro_batch(3e6, 20e6, None, 12) == 8  # a power of two within max_train_micro_batch_size
    assert second_micro_batch(50e6, 20e6, int(100e6), 1024) == 1  # not even 2 samples fit: no second profile


def _info(mb: int, saved: float, peak: float) -> dict:
    return {"micro_batch": mb, "activation_bytes": saved, "host_peak_bytes": peak, "device_peak_bytes": None}


def test_two_points_give_the_scale_and_the_runtime_offset() -> None:
    offset, states, per_sample, scale = 350e6, 16e6, 4e6, 1.5
    first = _info(1, per_sample, offset + states + scale * per_sample)
    second = _info(16, 16 * per_sample, offset + states + scale * 16 * per_sample)
    correction, note = two_point_correction(first, second, states)
    assert correction.scale == pytest.approx(scale) and correction.offset == pytest.approx(offset)
    assert correction.trials == 0 and note == "activation scale 1.500 from profiles at micro-batch 1 and 16"


@pytest.mark.parametrize("rise", [-5e6, 0.0, 1e10])
def test_a_slope_outside_the_plausible_range_keeps_scale_one(rise: float) -> None:
    first = _info(1, 4e6, 400e6)
    correction, note = two_point_correction(first, _info(16, 64e6, 400e6 + rise), 16e6)
    assert correction.scale == 1.0 and correction.offset == pytest.approx(400e6 - 16e6 - 4e6)
    assert "outside" in note


def test_the_device_peak_wins_where_there_is_one() -> None:
    first = {"micro_batch": 1, "activation_bytes": 1e6, "host_peak_bytes": 9e9, "device_peak_bytes": 30e6}
    second = {"micro_batch": 8, "activation_bytes": 8e6, "host_peak_bytes": 9e9, "device_peak_bytes": 44e6}
    correction, _ = two_point_correction(first, second, 10e6)
    assert correction.scale == pytest.approx(2.0) and correction.offset == pytest.approx(18e6)
