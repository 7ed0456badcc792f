"""Tied weights of a ``PipelineModule`` built under ``zero.Init`` (PP=2, ZeRO-3): each stage materializes its own
copy of the tied module, which the engine makes equal once materialized ([Note: tied sync after materialization]
in pipe/tied_sync.py), and ``seed_layers`` seeds every occurrence with its first occurrence's seed
([Note: seeded layers] in pipe/module.py). Parity with the plain build at ZeRO-3 under zero.Init is
``test_pipe_parity``'s ``zero_init`` case."""

from __future__ import annotations

from typing import Any

import torch
from pipe_models import BASE_SEED, gpt_layers, gpt_loss_fn, make_batches, rank_iterator

import shardspeed
from shardspeed.topology import MeshShape, Topology

MODEL = {"vocab": 32, "dim": 16, "n_blocks": 2, "seq": 6}
NAME = "tied_modules.embed.weight"
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000,
}


def _local_copy(engine: Any) -> torch.Tensor:
    """This stage's own copy of the tied weight, whole (a read-only gather over the data axis)."""
    param = engine.module.get_parameter(NAME)
    with shardspeed.zero.GatheredParameters(param):
        return param.detach().float().clone()


def _zero_init_copies(rank: int, world: int) -> dict[str, Any]:
    from shardspeed.pipe import PipelineModule

    topology = Topology.build(MeshShape(pipe=2, data=1))
    seeds: list[int] = []

    def seed_fn(seed: int) -> None:  # record, then seed as the default would
        seeds.append(seed)
        torch.manual_seed(seed)

    torch.manual_seed(100 + rank)  # without seed_layers each stage draws differently: only the sync ties them
    with shardspeed.zero.Init(config_dict_or_path=CONFIG):
        module = PipelineModule(gpt_layers(**MODEL), topology=topology, loss_fn=gpt_loss_fn, partition_method="uniform")
        seeded = PipelineModule(
            gpt_layers(**MODEL), topology=topology, seed_layers=True, seed_fn=seed_fn, partition_method="uniform"
        )
    engine, *_ = shardspeed.initialize(model=module, config=CONFIG)
    start = _local_copy(engine)
    it = rank_iterator(make_batches(2, 2, 2, 1, vocab=MODEL["vocab"], seq=MODEL["seq"]), 2, 0, 1)
    engine.train_batch(it)
    engine.train_batch(it)
    return {
        "start": start,
        "after": _local_copy(engine),
        "seeds": seeds,
        "layers": seeded.chunk_layers(),
    }


def test_zero_init_tied_copies_start_and_stay_equal(dist_run) -> None:
    first, last = dist_run(_zero_init_copies, 2)
    assert torch.equal(first["start"], last["start"])
    assert torch.equal(first["after"], last["after"])
    assert not torch.equal(first["start"], first["after"])  # training moved the tied weight: not vacuous
    # layers 0-2 on stage 0, 3-5 on stage 1: the head (layer 5) is the embedding's occurrence, seeded as layer 0
    assert first["layers"] == [0, 1, 2] and last["layers"] == [3, 4, 5]
    assert first["seeds"] == [BASE_SEED + i for i in (0, 1, 2)]
    assert last["seeds"] == [BASE_SEED + i for i in (3, 4, 0)]
