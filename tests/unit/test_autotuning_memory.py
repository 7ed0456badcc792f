"""Memory prediction, pruning and the fitted correction (autotuning/memory.py), and the saved-tensor counter
(autotuning/activation.py). No processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.autotuning.activation import SavedTensorCounter
from shardspeed.autotuning.memory import Budgets, Correction, ModelProfile, fit_correction, predict, prune
from shardspeed.autotuning.space import Point
from shardspeed.zero.memory import model_state_bytes

PROFILE = ModelProfile(num_params=1_000_000, activation_bytes_per_sample=2e6, checkpointed_bytes_per_sample=5e5)


def test_prediction_is_the_model_state_model_plus_scaled_activations() -> None:
    point = Point(2, 8, 1)
    states = model_state_bytes(1_000_000, 4, 2, precision="fp32", accounting="shardspeed")
    got = predict(point, PROFILE, 4, Correction(1.5, 3e8), on_cpu=True, precision="fp32")
    assert got.states == states
    assert got.activation_bytes == 8 * 2e6
    assert got.device_bytes == states.total() + 1.5 * 16e6
    assert got.measured_equivalent == 3e8 + states.total() + 1.5 * 16e6  # peak RSS: runtime + states + activations


def test_offload_moves_states_to_the_host_and_checkpointing_shrinks_activations() -> None:
    plain = predict(Point(3, 4, 1), PROFILE, 2, Correction())
    offloaded = predict(Point(3, 4, 1, "cpu", "cpu"), PROFILE, 2, Correction())
    checkpointed = predict(Point(3, 4, 1, checkpoint_activations=True), PROFILE, 2, Correction())
    assert offloaded.states.total() < plain.states.total() and offloaded.states.cpu > 0
    assert offloaded.device_bytes < plain.device_bytes
    assert checkpointed.activation_bytes == 4 * 5e5


def test_prune_counts_every_point_that_cannot_fit_and_says_why() -> None:
    points = [Point(0, mb, 1) for mb in (1, 4, 16, 64)]
    predictions = [predict(p, PROFILE, 2, Correction()) for p in points]
    budget = int(predictions[1].device_bytes) + 1
    kept, pruned = prune(points, predictions, Budgets(budget, None, 2))
    assert kept == [0, 1] and [i for i, _ in pruned] == [2, 3]
    assert "device" in pruned[0][1] and "budget" in pruned[0][1]
    offloaded = Point(3, 4, 1, "cpu", "cpu")
    host = prune([offloaded], [predict(offloaded, PROFILE, 2, Correction())], Budgets(None, 10**6, 2))[1]
    assert len(host) == 1 and "host" in host[0][1]  # offloaded states live in host memory


def test_fit_recovers_scale_and_offset_from_trials() -> None:
    truth = Correction(1.7, 2.5e8)
    samples = [(s, a, truth.offset + s + truth.scale * a, False) for s, a in [(1e7, 1e6), (2e7, 8e6), (5e6, 3e7)]]
    fitted = fit_correction(samples, Correction(1.0, 0.0))
    assert fitted.scale == pytest.approx(1.7) and fitted.offset == pytest.approx(2.5e8) and fitted.trials == 3


def test_checkpointed_points_get_their_own_scale() -> None:
    """Checkpointed points hold several times their counted bytes (one block recomputed): one shared scale fits
    neither kind (the demo's tune: 9.5 for both, +70% on a plain point)."""
    truth = Correction(1.3, 3.5e8, checkpointed_scale=6.0)
    plain = [(1e7, a, truth.offset + 1e7 + 1.3 * a, False) for a in (4e6, 7e7, 2e7)]
    ac = [(1e7, a, truth.offset + 1e7 + 6.0 * a, True) for a in (5e5, 3e7, 8e6)]
    fitted = fit_correction(plain + ac, Correction(1.0, 0.0))
    assert fitted.scale == pytest.approx(1.3) and fitted.checkpointed_scale == pytest.approx(6.0)
    assert fitted.offset == pytest.approx(3.5e8)
    assert fitted.scale_for(Point(0, 8, 1, checkpoint_activations=True)) == pytest.approx(6.0)
    assert fitted.scale_for(Point(0, 8, 1)) == pytest.approx(1.3)
    # fewer than MIN_FIT_TRIALS checkpointed trials: its scale stays the prior's (the profiles'), the plain one is
    # fitted (two trials differing in stage and offload too would give a slope of their runtime buffers)
    fitted = fit_correction(plain + ac[:2], Correction(1.0, 0.0, checkpointed_scale=5.0))
    assert fitted.scale == pytest.approx(1.3, rel=0.2) and fitted.checkpointed_scale == 5.0


def test_fit_with_one_activation_size_only_moves_the_offset() -> None:
    fitted = fit_correction([(1e7, 1e6, 3e8, False), (2e7, 1e6, 3.1e8, False)], Correction(1.2, 0.0))
    assert fitted.scale == 1.2 and fitted.offset == pytest.approx(3.05e8 - 1.5e7 - 1.2e6)
    assert fit_correction([], Correction(1.2, 5.0)) == Correction(1.2, 5.0)


def test_counter_counts_saved_activations_not_parameters_and_scales_with_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    figures = []
    for batch in (2, 8):
        counter = SavedTensorCounter(model.parameters())
        with counter.counting():
            loss = model(torch.randn(batch, 32)).sum()
        loss.backward()
        figures.append(counter.bytes)
    # input 32 + relu output 64 (saved once though both relu and the second linear keep it) ... per sample, fp32
    assert figures[1] == 4 * figures[0]
    assert figures[0] < sum(p.numel() * 4 for p in model.parameters())  # weights left out
    assert figures[0] >= 2 * (32 + 64) * 4


def test_counter_changes_nothing_backward_computes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SavedTensorCounter(model.parameters()).counting():
        loss = model(x).sum()
    loss.backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference, strict=True))
