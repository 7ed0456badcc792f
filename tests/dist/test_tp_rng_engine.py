"""The model-parallel RNG stream through ``initialize`` and checkpoints, at TP=2: seeding before ``initialize``
still gives each tensor rank its own stream ([Note: seeding before the tensor axis is known]), and a resume from a
checkpoint continues the tensor-parallel dropout masks bit-exactly (the trackers' states are saved per rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tp_gpt import TPGPT, GPTConfig

import shardspeed
from shardspeed import checkpointing
from shardspeed.checkpointing import RNGStatesTracker
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.random import TensorParallelDropout, model_parallel_seed
from shardspeed.tensor_parallel.sequence import SequenceParallelDropout
from shardspeed.topology import MeshShape, Topology

SEED, P, N = 5, 0.5, 2000
CFG = GPTConfig(dropout=0.3, layers=1)
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "steps_per_print": 1000,
}


def _expected(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return F.dropout(torch.ones(N), P, training=True) != 0


def _seed_then_initialize(rank: int, world: int, checkpointing_section: bool) -> dict:
    checkpointing.set_default_context(None)
    checkpointing.model_parallel_manual_seed(SEED)  # the natural order: seed first, then initialize
    topology = Topology.build(MeshShape(tensor=world))
    tp = TensorParallel.from_topology(topology, sequence_parallel=True)
    torch.manual_seed(0)
    model = TPGPT(CFG, tp)  # tracker None: its split dropouts draw from the default context's tracker
    extra = {"activation_checkpointing": {}} if checkpointing_section else {}
    shardspeed.initialize(model=model, mpu=topology, config={**CONFIG, **extra})
    ones = torch.ones(N)
    out = {
        "split": TensorParallelDropout(P, None, "split")(ones) != 0,  # the default context's tracker
        "sequence": SequenceParallelDropout(P, tp)(ones) != 0,
        "replicated": TensorParallelDropout(P, None, "replicated")(ones) != 0,
        "configured": checkpointing.is_configured(),
    }
    checkpointing.set_default_context(None)
    return out


@pytest.mark.parametrize("checkpointing_section", [True, False], ids=["configure", "no_configure"])
def test_seed_then_initialize_gives_each_tensor_rank_its_stream(dist_run, checkpointing_section: bool) -> None:
    masks = dist_run(_seed_then_initialize, 2, checkpointing_section)
    assert [m["configured"] for m in masks] == [checkpointing_section] * 2
    assert not torch.equal(masks[0]["split"], masks[1]["split"])  # split regions: the ranks' masks differ
    assert not torch.equal(masks[0]["sequence"], masks[1]["sequence"])
    assert torch.equal(masks[0]["replicated"], masks[1]["replicated"])  # replicated regions: equal masks
    for rank, m in enumerate(masks):  # the documented stream, as if seeded after the axis was known
        assert torch.equal(m["split"], _expected(SEED + 2718 + rank))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _engine(topology: Topology, explicit: bool) -> tuple[shardspeed.ShardSpeedEngine, RNGStatesTracker | None]:
    """A fresh run's start: the seeds a script sets at its top, the model, the engine."""
    checkpointing.set_default_context(None)
    tp = TensorParallel.from_topology(topology)
    tracker = RNGStatesTracker() if explicit else None
    if tracker is not None:  # a tracker given to the layers, carried by their TensorParallel too
        model_parallel_seed(tracker, tp, SEED)
        tp.tracker = tracker
    else:
        checkpointing.model_parallel_manual_seed(SEED)
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TPGPT(CFG, tp, tracker), mpu=topology, config=CONFIG)
    return engine, tracker


def _train(engine: shardspeed.ShardSpeedEngine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(*_batch(engine.global_steps))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _resume(rank: int, world: int, ckpt: str, explicit: bool) -> dict:
    topology = Topology.build(MeshShape(tensor=world))
    engine, _ = _engine(topology, explicit)
    straight = _train(engine, 4)
    engine, _ = _engine(topology, explicit)
    first = _train(engine, 2)
    engine.save_checkpoint(ckpt, tag="step2")
    _train(engine, 1)  # move every stream on, so the load must put them back
    engine, _tracker = _engine(topology, explicit)
    engine.load_checkpoint(ckpt, tag="step2")
    resumed = _train(engine, 2)
    checkpointing.set_default_context(None)
    return {"straight": straight, "first": first, "resumed": resumed}


@pytest.mark.parametrize("explicit", [False, True], ids=["default_tracker", "model_tracker"])
def test_resume_with_tensor_parallel_dropout_is_bit_exact(dist_run, tmp_path: Path, explicit: bool) -> None:
    results = dist_run(_resume, 2, str(tmp_path / "ckpt"), explicit)
    for r in results:
        assert r["first"] == r["straight"][:2]
        assert r["resumed"] == r["straight"][2:], (r["resumed"], r["straight"])
