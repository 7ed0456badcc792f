"""The seqlen curriculum on several ranks (training/curriculum.py): ZeRO 0 and 3 against a single-process reference
trained on the same global batches cut to the schedule's length at each step; resume mid-curriculum at another world
size and stage equals the uninterrupted run; a pipeline (PP=2) whose sequence length changes mid-run renegotiates its
activation shapes and equals the non-pipelined reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parity import optimizer_config, torch_optimizer
from pipe_models import gpt_layers, gpt_loss_fn, make_batches, rank_iterator, reference_model, reference_train

import shardspeed
from shardspeed.data.curriculum import CurriculumSchedule
from shardspeed.demo.model import GPT, GPTConfig

FULL, VOCAB, GLOBAL, STEPS = 16, 32, 8, 5
MODEL = GPTConfig(vocab_size=VOCAB, context_length=FULL, n_layer=1, d_model=16, n_head=2)
CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "truncate": True,
    "min_difficulty": 4,
    "max_difficulty": FULL,
    "schedule_type": "fixed_root",
    "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4, "root_degree": 2},
}
SCHEDULE = CurriculumSchedule(4, FULL, "fixed_root", 4, 4, 2.0)
LR, TOL = 3e-3, 1e-5


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (GLOBAL, FULL + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _engine(world: int, stage: int, gas: int) -> Any:
    torch.manual_seed(0)
    config = {
        "train_batch_size": GLOBAL,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer_config("adamw", LR),
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "curriculum_learning": CURRICULUM,
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=GPT(MODEL), config=config)
    return engine


def _run(rank: int, world: int, stage: int, gas: int, steps: range, save: str | None, load: str | None) -> dict:
    """Train ``steps`` (0-based global step indices) on this rank's slices of the global batches."""
    engine = _engine(world, stage, gas)
    if load is not None:
        engine.load_checkpoint(load)
    mb, dp = GLOBAL // (gas * world), engine.topology.data.size
    seen = []
    for x, y in (_batches()[k] for k in steps):
        for j in range(gas):  # the global-index sampler's layout: micro-batch j of rank r
            rows = slice((j * dp + engine.topology.data.rank) * mb, (j * dp + engine.topology.data.rank + 1) * mb)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
        seen.append(engine.curriculum_scheduler_legacy.get_current_difficulty())
    if save is not None:
        engine.save_checkpoint(save)
    return {"params": {k: v.float() for k, v in engine.module_state_dict().items()}, "seen": seen}


def _reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch_optimizer("adamw", model.parameters(), LR)
    for k, (x, y) in enumerate(_batches()[:steps]):
        s = SCHEDULE.difficulty_at(k + 1)  # the difficulty of global step k + 1 (DeepSpeed: global_steps + 1)
        opt.zero_grad()
        model(x[:, :s], y[:, :s]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_schedule_changes_length_during_the_run() -> None:
    lengths = [SCHEDULE.difficulty_at(k + 1) for k in range(STEPS)]
    assert lengths == [8, 12, 12, 16, 16]  # several lengths: the parity below is not vacuous


@pytest.mark.parametrize(("stage", "gas"), [(0, 2), (3, 1)])
def test_zero_stages_equal_the_reference(dist_run, stage: int, gas: int) -> None:
    want = _reference(STEPS)
    for r in dist_run(_run, 2, stage, gas, range(STEPS), None, None):
        assert r["seen"] == [8, 12, 12, 16, 16]
        assert _close(r["params"], want) <= TOL


def test_resume_mid_curriculum_at_another_world_size_and_stage(dist_run, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    dist_run(_run, 2, 3, 2, range(2), ckpt, None)  # world 2, ZeRO-3, GAS 2: steps 1-2
    resumed = dist_run(_run, 1, 0, 1, range(2, STEPS), None, ckpt)  # world 1, ZeRO-0, GAS 1: steps 3-5
    assert resumed[0]["seen"] == [12, 16, 16]
    assert _close(resumed[0]["params"], _reference(STEPS)) <= TOL


# --- pipeline ----------------------------------------------------------------------------------------------------
PIPE_MODEL = {"vocab": 32, "dim": 16, "n_blocks": 2, "seq": 8}
M, MB = 2, 2
PIPE_CURRICULUM = {
    **CURRICULUM,
    "max_difficulty": 8,
    "schedule_type": "fixed_discrete",
    "schedule_config": {"difficulty": [4, 6, 8], "max_step": [2, 3]},
}


def _cut_by_script(engine: Any, batches: Any) -> Any:
    """Without ``truncate`` the script's iterator shortens the batches (Megatron-DeepSpeed's way under a pipeline),
    reading the difficulty ``train_batch`` set before it reads the batch."""
    for x, y in batches:
        s = engine.curriculum_scheduler_legacy.get_current_difficulty()
        yield x[:, :s], y[:, :s]


def _pipe(rank: int, world: int, truncate: bool) -> dict:
    from shardspeed.pipe import PipelineModule
    from shardspeed.topology import MeshShape, Topology

    topology = Topology.build(MeshShape(pipe=2, data=1, tensor=1))
    module = PipelineModule(
        gpt_layers(**PIPE_MODEL), topology=topology, loss_fn=gpt_loss_fn, seed_layers=True, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": M,
        "optimizer": optimizer_config("adamw", LR),
        "curriculum_learning": {**PIPE_CURRICULUM, "truncate": truncate},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    batches = make_batches(STEPS, M, MB, 1, vocab=PIPE_MODEL["vocab"], seq=PIPE_MODEL["seq"])
    it = rank_iterator(batches, M, 0, 1)
    it = it if truncate else _cut_by_script(engine, it)
    losses, resets = [], []
    for _ in range(STEPS):
        step, before = engine.global_steps, engine.channel.stats.resets  # the channel counts renegotiations
        losses.append(float(engine.train_batch(it)))
        resets += [step] * (engine.channel.stats.resets - before)
    params = {k: v.float() for k, v in engine.module_state_dict().items()}
    return {"losses": losses, "params": params, "resets": resets}


@pytest.mark.parametrize("truncate", [True, False])
def test_pipeline_renegotiates_when_the_length_changes(dist_run, truncate: bool) -> None:
    schedule = CurriculumSchedule(4, 8, "fixed_discrete", difficulty=(4, 6, 8), max_step=(2, 3))
    batches = make_batches(STEPS, M, MB, 1, vocab=PIPE_MODEL["vocab"], seq=PIPE_MODEL["seq"])
    cut = []
    for k, (x, y) in enumerate(batches):
        s = schedule.difficulty_at(k + 1)
        cut.append((x[:, :s], y[:, :s]))
    ref = reference_model(**PIPE_MODEL)
    ref_losses = reference_train(ref, cut, torch_optimizer("adamw", ref.parameters(), LR), micro_batches=M)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for r in dist_run(_pipe, 2, truncate):
        assert r["resets"] == [0, 2, 3]  # first batch, 4 -> 6 before step 3, 6 -> 8 before step 4
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        assert max((r["params"][n] - want[n]).abs().max().item() for n in want) <= TOL
