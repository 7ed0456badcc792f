"""Resuming with 0-dim and 1-element trainable parameters (CLIP's logit scale) at another stage or world size.

A 0-dim parameter's Adam ``exp_avg`` is itself 0-dim: it must be saved as per-element state (a range of the
parameter), not confused with a per-tensor scalar like ``step``, so it loads into a flat shard slice at stages
1-3 (and back into a 0-dim tensor at stage 0). Parity: save after 3 steps, resume, 3 more steps ≡ 6 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardspeed

IN, STEPS, MB = 6, 3, 2


class ScaledModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(IN, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.5))  # 0-dim
        self.bias1 = torch.nn.Parameter(torch.tensor([0.3]))  # one element, 1-D

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.logit_scale + self.bias1


def _config(stage: int, optimizer: str) -> dict:
    opt = (
        {"type": "Adam", "params": {"lr": 0.05}}
        if optimizer == "adam"
        else {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    )
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "optimizer": opt,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 16, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(MB * 2, IN, generator=g), torch.randn(MB * 2, 4, generator=g)) for _ in range(2 * STEPS)]


def _run(rank: int, world: int, stage: int, optimizer: str, first: range, save: str | None, load: str | None) -> dict:
    torch.manual_seed(0)
    model = ScaledModel()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, optimizer)
    )
    if load is not None:
        path, _ = engine.load_checkpoint(load)
        assert path is not None
    per = MB * 2 // world  # the same global batch of 4 rows at any world size
    batches = _batches(world)
    for step in first:
        if save is not None and step == STEPS:  # the saving run goes on: it is the uninterrupted reference
            engine.save_checkpoint(save)
        x, y = batches[step]
        rows = slice(rank * per, (rank + 1) * per)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    return {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}


# (saved stage, saved world, loaded stage, loaded world, optimizer); the default suite keeps one case of each kind
FAST = [(0, 2, 1, 2, "adam"), (0, 2, 3, 2, "adam"), (3, 2, 0, 1, "adam")]
SLOW = [
    (0, 2, 2, 2, "adam"),
    (3, 2, 0, 2, "adam"),
    (0, 2, 2, 1, "adam"),
    (3, 2, 3, 1, "adam"),
    (0, 2, 1, 2, "sgd"),
    (0, 2, 3, 2, "sgd"),
    (3, 2, 0, 2, "sgd"),
]
CASES = FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW]


@pytest.mark.parametrize(("saved_stage", "saved_world", "loaded_stage", "loaded_world", "optimizer"), CASES)
def test_scalar_parameters_resume_at_any_stage_and_world(
    dist_run, tmp_path: Path, saved_stage: int, saved_world: int, loaded_stage: int, loaded_world: int, optimizer: str
) -> None:
    ckpt = str(tmp_path / "ckpt")
    full = dist_run(_run, saved_world, saved_stage, optimizer, range(2 * STEPS), ckpt, None)[0]
    resumed = dist_run(_run, loaded_world, loaded_stage, optimizer, range(STEPS, 2 * STEPS), None, ckpt)
    for state in resumed:
        assert state["logit_scale"].shape == ()
        for name, value in full.items():
            assert torch.allclose(state[name], value, atol=1e-5, rtol=0), (name, state[name], value)
        assert not torch.equal(full["logit_scale"], torch.tensor(2.5))  # it did train
