"""``initialize`` without an optimizer: an evaluation engine at every stage (DeepSpeed allows it; Hugging Face's
evaluation-only ZeRO-3 path uses it). Forward equals the plain module; backward/step say there is no optimizer;
module weights save and load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardspeed
from shardspeed.optim.absent import NoOptimizerError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def _eval_engine(rank: int, world: int, stage: int, where: str) -> dict:
    engine, optimizer, _, scheduler = shardspeed.initialize(model=_model(), config=_config(stage))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out = engine(x)
    errors = []
    loss = engine(x).sum()  # forward under autograd works too; training calls do not
    for call in (lambda: engine.backward(loss), engine.step):
        try:
            call()
        except NoOptimizerError as err:
            errors.append(str(err))
    with torch.no_grad():  # checkpoint: save, perturb, load back
        engine.save_checkpoint(where)
        before = {k: v.clone() for k, v in engine.module_state_dict().items()}
        for p in engine.module.parameters():
            with shardspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.add_(1.0)
        path, _ = engine.load_checkpoint(where)
        after = engine.module_state_dict()
    return {
        "x": x,
        "out": out,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "errors": errors,
        "restored": all(torch.equal(before[k], after[k]) for k in before) and path is not None,
        "lr": engine.get_lr(),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_without_optimizer_evaluates(dist_run, tmp_path: Path, stage: int) -> None:
    reference = _model()
    for r in dist_run(_eval_engine, 2, stage, str(tmp_path / "ckpt")):
        assert r["optimizer"] is None and r["scheduler"] is None and r["lr"] == []
        with torch.no_grad():
            assert torch.allclose(r["out"], reference(r["x"]), atol=1e-6, rtol=0)
        assert len(r["errors"]) == 2
        assert "engine.backward() needs an optimizer, but none was given to initialize()" in r["errors"][0]
        assert "engine.step() needs an optimizer" in r["errors"][1]
        assert r["restored"]


def _with_scheduler(rank: int, world: int) -> str:
    config = _config(0) | {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    try:
        shardspeed.initialize(model=_model(), config=config)
    except NoOptimizerError as err:
        return str(err)
    return "no error"


def test_scheduler_without_optimizer_is_a_clear_error(dist_run) -> None:
    for message in dist_run(_with_scheduler, 1):
        assert "an LR scheduler needs an optimizer, but none was given to initialize()" in message
