"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_*`` parameter accessors at every ZeRO stage, on 2 ranks, against a
plain-torch reference (fp32 ≤ 1e-5); mixed precision checked for consistency with the gathered model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, global_batches, make_model, rank_slice, train_engine

import shardspeed
from shardspeed.comm.algorithms import CollectiveChoice, SizeRule
from shardspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_optimizer_state,
)

MB, GAS, LR = 2, 2, 0.01


def _engine(stage: int, world: int, bf16: bool = False, offload: bool = False):
    model = make_model()
    config: dict = {
        "train_batch_size": MB * GAS * world,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }
    if offload:  # the optimizer's states and fp32 values live in its host store
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _reference(batches: list) -> dict[str, dict[str, torch.Tensor]]:
    """Plain torch: parameters and Adam moments after all but the last batch, and the last batch's gradients."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for x, y in batches[:-1]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    x, y = batches[-1]
    F.mse_loss(model(x), y).backward()
    return {
        "param": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grad": {n: p.grad.clone() for n, p in model.named_parameters()},
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()},
    }


def _read_all(rank: int, world: int, stage: int, offload: bool = False, all_reduce: bool = False) -> dict:
    batches = global_batches(3, MB * GAS * world)
    engine = _engine(stage, world, offload=offload)
    if all_reduce:  # reduce-scatter as an in-place all-reduce of the whole buffer ([Note: clobbered inputs])
        engine.collectives.algorithms = CollectiveChoice(reduce_scatter=(SizeRule(None, "all_reduce"),))
    train_engine(engine, rank, world, batches[:-1], MB, GAS)
    x, y = batches[-1]
    for m in range(GAS):  # the last window: backward only, so the reduced gradients are still there
        engine.backward(F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB)))
        if m < GAS - 1:
            engine.step()
    named = list(engine.module.named_parameters())
    out = {
        "param": {n: safe_get_full_fp32_param(p) for n, p in named},
        "grad": {n: safe_get_full_grad(p) for n, p in named},
        "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named},
        "local_numel": sum(safe_get_local_fp32_param(p).numel() for _, p in named),
        "local_grad_numel": sum(safe_get_local_grad(p).numel() for _, p in named),
        "local_grad": torch.cat([safe_get_local_grad(p) for _, p in named]),
        "counts": dict(engine.collectives.algorithm_counts),
    }
    engine.step()
    with pytest.raises(RuntimeError, match="valid window"):
        safe_get_full_grad(named[0][1])  # step() consumed and zeroed the gradients
    with pytest.raises(ValueError, match="no live shardspeed engine"):
        safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    return out


@pytest.mark.parametrize(
    "stage", [0, 3, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_safe_get_full_matches_plain_torch(
    dist_run, stage: int, offload: bool = False, all_reduce: bool = False
) -> None:
    world = 2
    results = dist_run(_read_all, world, stage, offload, all_reduce)
    ref = _reference(global_batches(3, MB * GAS * world))
    total = sum(p.numel() for p in ref["param"].values())
    for result in results:
        for kind in ("param", "grad", "exp_avg"):
            for name, expected in ref[kind].items():
                got = result[kind][name]
                assert got.dtype == torch.float32 and got.shape == expected.shape, (kind, name)
                assert (got - expected).abs().max().item() <= 1e-5, (kind, name)
    # local partitions: whole parameters at stage 0, disjoint shards that cover the model at stages 1-3
    local = [r["local_numel"] for r in results]
    assert local == ([total] * world if stage == 0 else local) and (stage == 0 or sum(local) == total)
    assert [r["local_grad_numel"] for r in results] == local
    # the local partitions are the reduced gradient: their squares add up to the whole gradient's (disjoint cover)
    local_sq = sum(float(r["local_grad"].double().square().sum()) for r in results) / (world if stage == 0 else 1)
    assert local_sq == pytest.approx(sum(float(g.double().square().sum()) for g in ref["grad"].values()), rel=1e-5)
    if all_reduce:
        assert all("reduce_scatter=native" not in r["counts"] for r in results)
        assert all(r["counts"].get("reduce_scatter=all_reduce", 0) > 0 for r in results)


def test_safe_get_grads_under_the_all_reduce_algorithm(dist_run) -> None:
    """Stage 1 fp32 all-reduces its whole gradient buffer in place: the slices this rank does not own then hold
    partial sums, which the accessors must never read (they read this rank's reduced slices and gather)."""
    test_safe_get_full_matches_plain_torch(dist_run, 1, all_reduce=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_get_full_with_an_offloaded_optimizer(dist_run, stage: int) -> None:
    test_safe_get_full_matches_plain_torch(dist_run, stage, offload=True)


def _write_all(rank: int, world: int, stage: int, bf16: bool) -> dict:
    batches = global_batches(2, MB * GAS * world)
    engine = _engine(stage, world, bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    train_engine(engine, rank, world, batches[:1], MB, GAS)
    named = list(engine.module.named_parameters())
    name, param = named[1]
    # fp32 value: written everywhere it lives (master, shard, training-dtype parameter)
    shape = shardspeed.zero.full_shape(param)
    value = torch.linspace(-1, 1, int(torch.tensor(shape).prod())).view(shape)
    safe_set_full_fp32_param(param, value)
    fp32_back = safe_get_full_fp32_param(param)
    model_value = full_params(engine)[name]
    # optimizer state: full write, then a local write of this rank's partition
    safe_set_full_optimizer_state(param, value * 3, "exp_avg")
    exp_avg_back = safe_get_full_optimizer_state(param, "exp_avg")
    local = safe_get_local_optimizer_state(param, "exp_avg")
    safe_set_local_optimizer_state(param, torch.full_like(local, float(rank + 1)), "exp_avg")
    exp_avg_local = safe_get_full_optimizer_state(param, "exp_avg")
    # gradient: between the boundary backward and step
    x, y = batches[1]
    for m in range(GAS):
        out = engine(rank_slice(x, m, rank, world, MB).to(dtype)).float()
        engine.backward(F.mse_loss(out, rank_slice(y, m, rank, world, MB)))
        if m < GAS - 1:
            engine.step()
    safe_set_full_grad(param, value * 5)
    grad_back = safe_get_full_grad(param)
    engine.step()
    return {
        "value": value,
        "fp32_back": fp32_back,
        "model_value": model_value,
        "dtype": str(next(engine.module.parameters()).dtype),
        "exp_avg_back": exp_avg_back,
        "exp_avg_local": exp_avg_local,
        "local_numel": local.numel(),
        "grad_back": grad_back,
    }


@pytest.mark.parametrize(
    ("stage", "bf16"),
    [
        (2, True),
        (3, True),
        pytest.param(0, False, marks=pytest.mark.slow),
        pytest.param(3, False, marks=pytest.mark.slow),
    ],
)
def test_safe_set_then_get_round_trips_and_reaches_the_model(dist_run, stage: int, bf16: bool) -> None:
    results = dist_run(_write_all, 2, stage, bf16)
    for result in results:
        value = result["value"]
        assert torch.equal(result["fp32_back"], value)
        # the training-dtype parameter (gathered) is the fp32 value rounded to it
        rounded = value.to(torch.bfloat16).float() if bf16 else value
        assert torch.equal(result["model_value"], rounded)
        assert torch.allclose(result["exp_avg_back"], value * 3, atol=1e-6)
        assert torch.allclose(result["grad_back"], value * 5, atol=1e-5)
    # every rank wrote its own partition: each element of exp_avg is its owner's rank + 1 (stage 0: all own all,
    # rank 0's local write is what the replicated read returns on rank 0, rank 1's on rank 1)
    for rank, result in enumerate(results):
        got = result["exp_avg_local"]
        if stage == 0:
            assert torch.equal(got, torch.full_like(got, float(rank + 1)))
        else:
            assert set(got.unique().tolist()) <= {1.0, 2.0} and (got == 1.0).sum() == results[0]["local_numel"]
