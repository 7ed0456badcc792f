"""Predicted vs measured memory on the model's own part (probe.py [Note: accounted memory]): the metric record's
figure and the trial row's error, pure; and one real single-process engine's accounted figures."""

from __future__ import annotations

import pytest
import torch

from shardspeed.autotuning.probe import metric_record
from shardspeed.autotuning.results import TrialRow


def _record(memory: list[dict]) -> dict:
    return metric_record(
        latency_s=1.0, samples_per_s=1.0, world_size=len(memory), flops_per_sample=None, memory=memory,
        predicted_memory={}, window_steps=1,
    )  # fmt: skip


def test_the_record_takes_the_largest_ranks_states_plus_activations() -> None:
    rank = {"host_peak_bytes": 400_000_000, "device_peak_bytes": None}
    record = _record([{**rank, "rank": 0, "model_state_bytes": 100, "activation_bytes": 50},
                      {**rank, "rank": 1, "model_state_bytes": 120, "activation_bytes": 10}])  # fmt: skip
    assert record["max_accounted_bytes"] == 150
    assert _record([{**rank, "rank": 0}])["max_accounted_bytes"] is None  # an older engine: no figure, no error


def test_the_rows_error_is_on_the_model_part_not_the_runtime() -> None:
    # a 350 MB runtime hides a 2x error in the model's 20 MB at the RSS level (~ -5%); the accounted error shows it
    row = TrialRow("z1_mb4_gas1", {}, "ok", predicted_bytes=360e6, measured_bytes=380e6)
    row.predicted_accounted_bytes, row.accounted_bytes = 10e6, 20e6
    assert row.prediction_error() == pytest.approx(-20 / 380)
    assert row.accounted_error() == pytest.approx(-0.5)
    assert TrialRow("x", {}, "pruned", predicted_accounted_bytes=1.0).accounted_error() is None


def test_a_real_engine_reports_its_states_and_activation_peak(tmp_path) -> None:
    import shardspeed
    from shardspeed.autotuning.probe import AutotuningExit
    from shardspeed.zero.memory import model_state_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    section = {"enabled": True, "start_profile_step": 2, "end_profile_step": 3,
               "metric_path": str(tmp_path / "m.json"), "progress_path": str(tmp_path / "p.jsonl")}  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}, "autotuning": section}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, config=config)
    with pytest.raises(AutotuningExit):
        for _ in range(5):
            x = torch.randn(8, 32)
            engine.backward(engine(x).square().mean())
            engine.step()
    import json

    rank = json.loads((tmp_path / "m.json").read_text())["memory"][0]
    params = sum(p.numel() for p in model.parameters())
    states = model_state_bytes(params, 1, 1, precision="fp32", accounting="shardspeed").total()
    assert rank["model_state_bytes"] == pytest.approx(states, rel=0.05)
    # saved tensors of one micro-batch: the input, the hidden pre/post ReLU, the output (fp32), at least
    assert 8 * (32 + 64) * 4 <= rank["activation_bytes"] < 8 * (32 + 3 * 64 + 2) * 4 * 2
