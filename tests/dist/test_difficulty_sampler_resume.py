"""The difficulty-aware sampler inside the engine (``initialize(training_data=...)`` with
``data_efficiency.data_sampling.curriculum_learning``): a run checkpointed mid-curriculum and resumed at another
world size (2 -> 4 and 4 -> 2, same train_batch_size, different ZeRO stage and GAS) sees exactly the uninterrupted
run's global batches and reaches its parameters; every batch holds only samples eligible at that step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from parity import IN, OUT, make_model

import shardspeed
from shardspeed.data.analyzer import write_metric_files
from shardspeed.data.curriculum import CurriculumSchedule

N, GLOBAL_BATCH, MB = 64, 8, 2
VALUES = np.random.default_rng(11).integers(0, 11, size=N)  # the metric of each sample: 0..10
SCHEDULE = {"min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear"}
SCHEDULE_CONFIG = {"total_curriculum_step": 8, "difficulty_step": 1}


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, IN, generator=g)
    return torch.utils.data.TensorDataset(torch.arange(N), x, torch.tanh(x @ torch.randn(IN, OUT, generator=g)))


def _run(rank: int, world: int, files: str, stage: int, steps: int, save_to: str | None, load_from: str | None):
    model = make_model()
    metric = {
        "index_to_sample_path": f"{files}/m/m_index_to_sample",
        "index_to_metric_path": f"{files}/m/m_index_to_metric",
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        **SCHEDULE,
        "schedule_config": SCHEDULE_CONFIG,
    }
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
        "steps_per_print": 1000,
        "data_efficiency": {
            "enabled": True,
            "seed": 5,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 3,
                "curriculum_learning": {"enabled": True, "curriculum_metrics": {"m": metric}},
            },
        },
    }
    engine, _, loader, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=_dataset(), config=config
    )
    if load_from is not None:
        assert engine.load_checkpoint(load_from)[0] is not None
    seen, batches = [], iter(shardspeed.RepeatingLoader(loader))
    for _ in range(steps * engine.gradient_accumulation_steps()):
        idx, x, y = next(batches)
        seen.append(idx.tolist())
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    if save_to is not None:
        engine.save_checkpoint(save_to)
    params = {k: v.float() for k, v in engine.module_state_dict().items()}
    return {"seen": seen, "gas": engine.gradient_accumulation_steps(), "params": params}


def _global_batches(results: list[dict]) -> list[list[int]]:
    """Per optimizer step, the global batch: micro-step by micro-step, rank by rank."""
    gas, micro = results[0]["gas"], len(results[0]["seen"])
    return [
        [i for m in range(step * gas, (step + 1) * gas) for r in results for i in r["seen"][m]]
        for step in range(micro // gas)
    ]


@pytest.mark.parametrize(  # (world, ZeRO stage)
    ("saved", "loaded"), [((2, 2), (4, 1)), pytest.param((4, 1), (2, 2), marks=pytest.mark.slow)]
)
def test_resume_mid_curriculum_at_another_world_size(dist_run, tmp_path: Path, saved: tuple, loaded: tuple) -> None:
    files = str(tmp_path / "metric")
    write_metric_files(VALUES, files, "m")
    full = dist_run(_run, 2, files, 2, 10, None, None)
    reference = _global_batches(full)
    schedule = CurriculumSchedule(**SCHEDULE, **SCHEDULE_CONFIG)
    for step, batch in enumerate(reference):
        assert len(batch) == GLOBAL_BATCH and max(VALUES[batch]) <= schedule.difficulty_at(step + 1), step
    (s_world, s_stage), (l_world, l_stage) = saved, loaded
    first = dist_run(_run, s_world, files, s_stage, 5, str(tmp_path / "ckpt"), None)
    second = dist_run(_run, l_world, files, l_stage, 5, None, str(tmp_path / "ckpt"))
    assert _global_batches(first) + _global_batches(second) == reference
    for name, value in full[0]["params"].items():
        assert (value - second[0]["params"][name]).abs().max().item() <= 1e-5, name
