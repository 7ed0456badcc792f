"""1-bit LAMB's math on one process: coefficient helpers, the phase switch, the flat compression, resume."""

from __future__ import annotations

import pytest
import torch
from onebit_reference import problem, run_ours

from shardspeed.compression.onebit_lamb import (
    OneBitLamb,
    clamp_factor,
    coefficient_ema,
    lamb_trust_ratio,
    scaling_coefficients,
)


def test_trust_ratio_clamps_and_falls_back_to_one() -> None:
    assert lamb_trust_ratio(2.0, 1.0, 0.01, 10.0) == 2.0
    assert lamb_trust_ratio(100.0, 1.0, 0.01, 10.0) == 10.0
    assert lamb_trust_ratio(1e-6, 1.0, 0.01, 10.0) == 0.01
    assert lamb_trust_ratio(0.0, 1.0, 0.01, 10.0) == 1.0
    assert lamb_trust_ratio(1.0, 0.0, 0.01, 10.0) == 1.0


def test_coefficient_ema_skips_exact_ones() -> None:
    assert coefficient_ema(2.0, 1.0, 0.9) == 2.0
    assert coefficient_ema(0.0, 3.0, 0.9) == pytest.approx(0.3)


def test_clamp_factor_limits_range_then_change() -> None:
    assert clamp_factor(10.0, 1.0, 0.5, 4.0, 0.1) == pytest.approx(1.1)  # [0.5, 4] first, then +10%
    assert clamp_factor(0.1, 1.0, 0.5, 4.0, 0.1) == pytest.approx(0.9)
    assert clamp_factor(3.0, 3.0, 0.5, 4.0, 0.1) == 3.0
    assert clamp_factor(9.0, 3.9, 0.5, 4.0, 0.5) == 4.0


def test_scaling_coefficients_bring_every_tensor_to_the_mean_scale() -> None:
    ks = scaling_coefficients([1.0, 3.0, 0.0])
    assert ks == pytest.approx([4 / 3, 4 / 9, 1.0])  # a zero momentum keeps k = 1 (DeepSpeed divides by 0)


class HalvingComm:
    world = 2

    def __init__(self) -> None:
        self.keys: list[tuple[str, int]] = []

    def exact_mean(self, tensors):
        raise AssertionError("1-bit LAMB never asks for an exact mean: the engine all-reduces in the warm-up")

    def compressed_mean(self, key, tensor):
        self.keys.append((key, tensor.numel()))

    def reset_errors(self):
        pass

    def errors_state_dict(self):
        return {}

    def load_errors_state_dict(self, sd):
        pass


def test_owns_communication_after_freeze_step_and_compresses_one_flat_bucket() -> None:
    params, grads = problem(4, 8)
    live = [torch.nn.Parameter(t.clone()) for t in params] + [torch.nn.Parameter(torch.empty(0))]
    opt = OneBitLamb(live, lr=0.01, freeze_step=4)
    comm = HalvingComm()
    opt.bind_comm(comm)
    owned = []
    for step_grads in grads:
        owned.append(opt.owns_communication)
        for p, g in zip(live, step_grads, strict=False):
            p.grad = g.clone()
        opt.step()
    # The first step only creates states; DeepSpeed freezes after its step freeze_step (counting that one).
    assert owned == [False, False, False, False, True, True, True, True]
    total = sum(t.numel() for t in params)
    assert comm.keys == [("momentum", total)] * 4  # the empty tensor is skipped, as DeepSpeed filters it


def test_resume_from_state_dict_is_bit_exact() -> None:
    kwargs = {"lr": 0.01, "freeze_step": 4, "weight_decay": 0.01}
    params, grads = problem(5, 12)
    straight, _ = run_ours(OneBitLamb, kwargs, params, grads, first_step=False)
    for cut in (2, 6):  # inside the warm-up (the coefficient EMA must survive) and in the compression stage
        live = [torch.nn.Parameter(t.clone()) for t in params]
        first = OneBitLamb(live, **kwargs)
        for step_grads in grads[:cut]:
            for p, g in zip(live, step_grads, strict=True):
                p.grad = g.clone()
            first.step()
        second = OneBitLamb(live, **kwargs)
        second.load_state_dict(first.state_dict())
        for step_grads in grads[cut:]:
            for p, g in zip(live, step_grads, strict=True):
                p.grad = g.clone()
            second.step()
        assert all(torch.equal(p.detach(), w) for p, w in zip(live, straight[-1], strict=True)), cut


def test_rejects_bad_hyperparameters() -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="factor_min"):
        OneBitLamb(p, factor_min=5.0, factor_max=4.0)
    with pytest.raises(ValueError, match="min_coeff"):
        OneBitLamb(p, min_coeff=0.0)
