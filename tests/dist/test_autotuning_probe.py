"""The engine side of an autotuning trial at world 2 (autotuning/probe.py): per-step progress records, the metric
JSON after ``end_profile_step`` (throughput, latency, flops, every rank's peak memory) and the same clean exit
(``AutotuningExit``, status 0) on every rank at the same step; the model-info profile's saved-activation bytes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import shardspeed
from shardspeed.autotuning.probe import PROFILE_STEPS, AutotuningExit
from shardspeed.demo.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, context_length=16, n_layer=2, d_model=32, n_head=2)
MB, SEQ = 2, 16


def _trial(rank: int, world: int, out: str, autotuning: dict, extra: dict) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "autotuning": {"enabled": True, **autotuning},
        **extra,
    }
    engine, *_ = shardspeed.initialize(model=GPT(CFG), config=config)
    g = torch.Generator().manual_seed(10 + rank)
    code = None
    try:
        for _ in range(200):
            tokens = torch.randint(0, CFG.vocab_size, (MB, SEQ), generator=g)
            engine.backward(engine(tokens, tokens))
            engine.step()
    except AutotuningExit as stop:
        code = stop.code
    return {"code": code, "steps": engine.global_steps}


def test_metric_json_and_the_same_clean_exit_on_every_rank(dist_run, tmp_path: Path) -> None:
    section = {
        "start_profile_step": 2,
        "end_profile_step": 4,
        "metric_path": str(tmp_path / "metrics.json"),
        "progress_path": str(tmp_path / "progress.jsonl"),
    }
    flops = {"flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False}}
    results = dist_run(_trial, 2, str(tmp_path), section, flops)
    assert [r["code"] for r in results] == [0, 0]
    assert [r["steps"] for r in results] == [4, 4]  # both ranks stopped right after end_profile_step
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["throughput"] > 0 and metrics["latency"] > 0 and metrics["window_steps"] == 2
    assert metrics["flops"] > 0 and metrics["world_size"] == 2
    assert [m["rank"] for m in metrics["memory"]] == [0, 1]
    assert all(m["host_peak_bytes"] > 10**7 for m in metrics["memory"])
    assert metrics["max_host_peak_bytes"] == max(m["host_peak_bytes"] for m in metrics["memory"])
    # the throughput is samples per second of the whole group: batch 2 × GAS 2 × 2 ranks per step
    assert abs(metrics["throughput"] * metrics["latency"] - 8) < 1e-6 * 8 + 0.5
    records = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in records)


def test_model_info_profile_counts_saved_activations_and_exits_after_its_steps(dist_run, tmp_path: Path) -> None:
    section = {
        "model_info": {"profile": True},
        "model_info_path": str(tmp_path / "info.json"),
        "progress_path": str(tmp_path / "progress.jsonl"),
    }
    results = dist_run(_trial, 2, str(tmp_path), section, {})
    assert [(r["code"], r["steps"]) for r in results] == [(0, PROFILE_STEPS)] * 2
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["num_params"] == GPT(CFG).num_parameters() and info["micro_batch"] == MB
    # at least the embeddings' output and the logits of each sample are saved (fp32)
    assert info["activation_bytes"] >= MB * SEQ * (CFG.d_model + CFG.vocab_size) * 4
