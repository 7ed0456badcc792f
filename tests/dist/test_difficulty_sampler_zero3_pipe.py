"""The difficulty sampler under ZeRO-3 and under pipeline parallelism (issue 20: every ZeRO stage and PP): the global
batches each run consumes equal the pure sampler's (data/difficulty_sampler.py), and under PP=2, where
``train_batch`` reads the engine's own loader on both stages, the losses and parameters equal plain torch trained on
those batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from parity import optimizer_config, torch_optimizer
from pipe_models import gpt_layers, gpt_loss_fn, make_batches, reference_model, reference_train
from test_difficulty_sampler_resume import GLOBAL_BATCH, SCHEDULE, SCHEDULE_CONFIG, VALUES, N, _global_batches, _run

import shardspeed
from shardspeed.data.analyzer import load_metric_index, write_metric_files
from shardspeed.data.curriculum import CurriculumSchedule
from shardspeed.data.difficulty import MetricCurriculum
from shardspeed.data.difficulty_sampler import DifficultySampler


def _pure(files: str, n: int, batch: int, count: int, seed: int = 5) -> list[list[int]]:
    index = load_metric_index(f"{files}/m/m_index_to_sample", f"{files}/m/m_index_to_metric")
    metric = MetricCurriculum("m", CurriculumSchedule(**SCHEDULE, **SCHEDULE_CONFIG), "value", index)
    sampler = DifficultySampler(
        (metric,),
        n,
        micro_batch_size=batch,
        gradient_accumulation_steps=1,
        dp_rank=0,
        dp_world_size=1,
        seed=seed,
        num_epochs=3,
    )
    return [b.tolist() for b in sampler.global_batches(count)]


def test_zero3_consumes_the_pure_samplers_batches(dist_run, tmp_path: Path) -> None:
    files = str(tmp_path / "metric")
    write_metric_files(VALUES, files, "m")
    got = _global_batches(dist_run(_run, 2, files, 3, 4, None, None))
    assert got == _pure(files, N, GLOBAL_BATCH, 4)


PIPE_MODEL = {"vocab": 32, "dim": 16, "n_blocks": 2, "seq": 8}
M, MB, STEPS, PIPE_N = 2, 2, 4, 32
LR, TOL = 3e-3, 1e-5
PIPE_VALUES = np.random.default_rng(3).integers(0, 11, size=PIPE_N)


def _pipe_data() -> torch.utils.data.TensorDataset:
    batches = make_batches(PIPE_N // (M * MB), M, MB, 1, vocab=PIPE_MODEL["vocab"], seq=PIPE_MODEL["seq"])
    return torch.utils.data.TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))


def _pipe(rank: int, world: int, files: str) -> dict:
    from shardspeed.pipe import PipelineModule
    from shardspeed.topology import MeshShape, Topology

    topology = Topology.build(MeshShape(pipe=2, data=1, tensor=1))
    module = PipelineModule(
        gpt_layers(**PIPE_MODEL), topology=topology, loss_fn=gpt_loss_fn, seed_layers=True, partition_method="uniform"
    )
    metric = {
        "index_to_sample_path": f"{files}/m/m_index_to_sample",
        "index_to_metric_path": f"{files}/m/m_index_to_metric",
        "difficulty_type": "value",
        **SCHEDULE,
        "schedule_config": SCHEDULE_CONFIG,
    }
    sampling = {"num_epochs": 3, "curriculum_learning": {"enabled": True, "curriculum_metrics": {"m": metric}}}
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": M,
        "optimizer": optimizer_config("adamw", LR),
        "steps_per_print": 1000,
        "data_efficiency": {"seed": 5, "data_sampling": sampling},
    }
    engine, _, loader, _ = shardspeed.initialize(model=module, config=config, training_data=_pipe_data())
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    params = {k: v.float() for k, v in engine.module_state_dict().items()}
    return {"losses": losses, "params": params, "batches": loader.sampler.state_dict()["global_batches"]}


def test_pipeline_train_batch_reads_the_difficulty_loader(dist_run, tmp_path: Path) -> None:
    files = str(tmp_path / "metric")
    write_metric_files(PIPE_VALUES, files, "m")
    data = _pipe_data()
    order = _pure(files, PIPE_N, M * MB, STEPS)
    schedule = CurriculumSchedule(**SCHEDULE, **SCHEDULE_CONFIG)
    assert all(max(PIPE_VALUES[b]) <= schedule.difficulty_at(k + 1) for k, b in enumerate(order))
    ref = reference_model(**PIPE_MODEL)
    batches = [(data.tensors[0][b], data.tensors[1][b]) for b in order]
    ref_losses = reference_train(ref, batches, torch_optimizer("adamw", ref.parameters(), LR), micro_batches=M)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for r in dist_run(_pipe, 2, str(files)):
        assert r["batches"] == STEPS
        assert np.allclose(r["losses"], ref_losses, atol=TOL, rtol=0)
        assert max((r["params"][n] - want[n]).abs().max().item() for n in want) <= TOL
