"""Mixed precision on stages 0-2: bf16 tracks fp32; fp16 unscales exactly and skips overflowing steps everywhere."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice

import shardspeed

MB = 4


def _config(**extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "steps_per_print": 1000,
        **extra,
    }


def _final_loss(rank: int, world: int, precision: dict, stage: int = 0) -> float:
    model = make_model()
    config = _config(**precision, zero_optimization={"stage": stage, "reduce_bucket_size": 200})
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = next(engine.module.parameters()).dtype
    batches = global_batches(30, MB * world)
    for x, y in batches:
        out = engine(rank_slice(x, 0, rank, world, MB).to(dtype))
        engine.backward(F.mse_loss(out.float(), rank_slice(y, 0, rank, world, MB)))
        engine.step()
    x, y = global_batches(1, 64, seed=99)[0]
    with torch.no_grad():
        return F.mse_loss(engine(x.to(dtype)).float(), y).item()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_loss_within_two_percent_of_fp32(dist_run, stage: int) -> None:
    fp32 = dist_run(_final_loss, 2, {}, stage)
    bf16 = dist_run(_final_loss, 2, {"bf16": {"enabled": True}}, stage)
    start = _initial_loss()
    assert fp32[0] < 0.95 * start, "training must make progress for the comparison to mean something"
    assert abs(bf16[0] - fp32[0]) <= 0.02 * fp32[0]


def _initial_loss() -> float:
    x, y = global_batches(1, 64, seed=99)[0]
    with torch.no_grad():
        return F.mse_loss(make_model()(x), y).item()


def _fp16_step(rank: int, world: int, inject_inf_on: int | None, stage: int) -> dict:
    model = make_model()
    config = _config(
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
        fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        gradient_clipping=0.3,
        zero_optimization={"stage": stage, "reduce_bucket_size": 200},
    )
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = global_batches(1, MB * world)[0]
    out = engine(rank_slice(x, 0, rank, world, MB).half())
    loss = F.mse_loss(out.float(), rank_slice(y, 0, rank, world, MB))
    if inject_inf_on == rank:
        loss = loss * float("inf")
    scale = engine.loss_scaler.scale
    # What the optimizer steps: fp32 masters (stage 0) or this rank's fp32 master shards (stages 1/2).
    stepped = [t for g in engine.optimizer.param_groups for t in g["params"]]
    masters_before = torch.cat([t.detach().flatten() for t in stepped])
    engine.backward(loss)
    scaled_grads = torch.cat([t.grad.flatten() for t in stepped])
    engine.step()
    return {
        "scale_before": scale,
        "scale_after": engine.loss_scaler.scale,
        "skipped": engine.skipped_steps,
        "norm": engine.get_global_grad_norm(),
        "masters_before": masters_before,
        "masters_after": torch.cat([t.detach().flatten() for t in stepped]),
        "scaled_grads": scaled_grads,
        "params": torch.cat([p.detach().float().flatten() for p in engine.parameters()]),  # waits for the gathers
        "masters_as_fp16": torch.cat([t.detach().half().float().flatten() for t in stepped]),
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_step_equals_fp32_step_on_unscaled_grads(dist_run, stage: int) -> None:
    results = dist_run(_fp16_step, 2, None, stage)
    for r in results:
        grads = r["scaled_grads"] / r["scale_before"]  # the unscaled, averaged fp32 gradients (this rank's part)
        norm = r["norm"]  # global, over every rank's part
        assert norm > 0.3, "clipping must be active"
        if stage == 0:
            assert norm == pytest.approx(grads.norm().item(), rel=1e-6)
        expected = r["masters_before"] - 0.1 * grads * min(1.0, 0.3 / (norm + 1e-6))
        assert torch.allclose(r["masters_after"], expected, atol=1e-6, rtol=0)
        assert r["skipped"] == 0 and r["scale_after"] == r["scale_before"]
    # every rank holds the same fp16 parameters: the fp16 rounding of the (gathered) new masters
    assert torch.equal(results[0]["params"], results[1]["params"])
    if stage == 0:
        assert torch.equal(torch.sort(results[0]["params"])[0], torch.sort(results[0]["masters_as_fp16"])[0])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_inf_on_one_rank_skips_step_everywhere(dist_run, stage: int) -> None:
    results = dist_run(_fp16_step, 2, 1, stage)
    for r in results:
        assert r["skipped"] == 1
        assert r["scale_after"] == r["scale_before"] / 2
        assert torch.equal(r["masters_after"], r["masters_before"])
        assert not math.isfinite(r["scaled_grads"].sum().item())
    assert torch.equal(results[0]["params"], results[1]["params"])
