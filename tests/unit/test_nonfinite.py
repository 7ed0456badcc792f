"""The pure logic of non-finite steps (training/nonfinite.py): counters, limits, messages, the first-offender
agreement (with a stand-in for the collective), and the loss scaler's ``at_minimum``."""

from __future__ import annotations

import logging

import pytest
import torch

from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.precision.loss_scaler import LossScaler
from shardspeed.topology import AxisGroup
from shardspeed.training.nonfinite import (
    FP16ScaleStuckError,
    NonFiniteGradientsError,
    NonFiniteGuard,
    NonFiniteTracker,
    agree_first_nonfinite,
)

ORDER = ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"]
AXIS = AxisGroup("data", None, (0, 1), 0)


class PeerMax:
    """A two-rank MAX all-reduce whose other rank contributed ``peer_names``' negated lowest index."""

    def __init__(self, peer_names: list[str]) -> None:
        index = {n: i for i, n in enumerate(ORDER)}
        self.peer = -float(min((index[n] for n in peer_names), default=len(ORDER) + 1))
        self.calls = 0

    def all_reduce_max(self, tensor: torch.Tensor, axis: AxisGroup, *, tag: str = "") -> None:
        self.calls += 1
        tensor.clamp_(min=self.peer)


def test_tracker_raises_at_the_kth_consecutive_step_naming_steps_and_parameter() -> None:
    t = NonFiniteTracker(max_consecutive=3, min_scale_patience=10)
    assert t.record_nonfinite(4, "b.weight") is None
    t.record_finite()  # a clean step restarts the count
    assert t.record_nonfinite(6, "c.weight") is None
    assert t.record_nonfinite(7, "a.weight") is None
    error = t.record_nonfinite(8, None)
    assert isinstance(error, NonFiniteGradientsError)
    assert str(error).startswith("3 consecutive steps had NaN/Inf gradients (steps 6-8; first offending parameter")
    assert "c.weight" in str(error) and "max_consecutive_nonfinite=3" in str(error)


def test_tracker_zero_means_never_raise() -> None:
    t = NonFiniteTracker(max_consecutive=0, min_scale_patience=10)
    assert all(t.record_nonfinite(s, "x") is None for s in range(1, 100))


def test_fp16_patience_counts_only_consecutive_overflows_at_the_minimum() -> None:
    t = NonFiniteTracker(max_consecutive=5, min_scale_patience=2)
    assert not t.record_fp16_overflow(1, at_min=False)
    assert not t.record_fp16_overflow(2, at_min=True)
    t.record_fp16_clean()
    assert not t.record_fp16_overflow(3, at_min=True)
    assert not t.record_fp16_overflow(4, at_min=False)  # the scale went up in between: a new run
    assert not t.record_fp16_overflow(5, at_min=True)
    assert t.record_fp16_overflow(6, at_min=True)
    error = t.fp16_error(1.0, "a.weight")
    assert isinstance(error, FP16ScaleStuckError)
    assert str(error).startswith("fp16 loss scale stuck at min_loss_scale=1 for 2 steps (steps 5-6;")
    assert "use bf16 or lower the LR" in str(error)


@pytest.mark.parametrize(
    "mine,peer,expected",
    [
        (["c.weight"], ["b.weight", "c.weight"], "b.weight"),  # the lowest index wins, whoever holds it
        (["b.bias", "a.bias"], [], "a.bias"),  # local order does not matter
        ([], [], None),  # the norm overflowed with every gradient finite
        (["outside"], [], "outside"),  # a name outside the registration order is reported by name
    ],
)
def test_first_offender_is_agreed_by_registration_index(mine: list[str], peer: list[str], expected: str | None) -> None:
    collectives = PeerMax(peer)
    assert agree_first_nonfinite(mine, ORDER, collectives, AXIS, torch.device("cpu")) == expected  # type: ignore[arg-type]
    assert collectives.calls == 1


def _guard(**fields: object) -> NonFiniteGuard:
    model = torch.nn.Linear(2, 2)
    return NonFiniteGuard(FaultToleranceConfig(**fields), model)


def test_guard_decides_by_setting() -> None:
    log = logging.getLogger("test_nonfinite")
    located = []

    def locate() -> str:
        located.append(1)
        return "weight"

    guard = _guard()
    assert guard.order == ["weight", "bias"] and not guard.forces_norm
    assert guard.fp32_verdict(float("nan"), False, 1, locate, log, True) == (False, None)  # not computed: unknown
    assert guard.fp32_verdict(3.0, True, 2, locate, log, True) == (False, None)
    assert located == []  # the finite path costs no collective
    assert guard.fp32_verdict(float("inf"), True, 3, locate, log, True) == (True, None)
    assert _guard(skip_nonfinite_steps=True).forces_norm
    assert _guard(skip_nonfinite_steps=False).fp32_verdict(float("nan"), True, 1, locate, log, True) == (False, None)
    skipped, error = _guard(max_consecutive_nonfinite=1).fp32_verdict(float("nan"), True, 9, locate, log, False)
    assert skipped and isinstance(error, NonFiniteGradientsError) and "step 9" in str(error)


def test_loss_scaler_at_minimum_only_when_dynamic() -> None:
    scaler = LossScaler(dynamic=True, init_scale=2.0, hysteresis=1, min_scale=1.0)
    assert not scaler.at_minimum
    scaler.update(overflow=True)
    assert scaler.scale == 1.0 and scaler.at_minimum
    assert scaler.update(overflow=True) == "fp16 overflow: step skipped, loss scale already at min_loss_scale 1"
    assert not LossScaler(dynamic=False, init_scale=1.0, min_scale=1.0).at_minimum
