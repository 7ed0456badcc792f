"""Step decisions agreed over the world with a tensor axis ([Note: agreed step] in training/step_core.py).

An Inf in one tensor rank's gradient of a *partitioned* parameter is seen by that rank alone (no data-parallel
reduction carries it to the other slices' holders); the norm, added over the model scope, still makes every rank
of the world skip the step together — fp16: and lower the loss scale alike; fp32: report the same offending
parameter. Gradient clearings that differ between tensor ranks are one agreed error on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_tp_grad_norm import MB, batches, engine_config, tp_engine

from harness import RankFailure
from shardspeed.topology import MeshShape, Topology

INF_STEP = 2  # 0-based step whose gradient gets the Inf


def _poison_on_tensor_rank_1(engine, topology: Topology, step: list[int]) -> None:
    """An Inf in tensor rank 1's gradient of ``up.weight`` (column-parallel: each tensor rank holds other rows)."""
    weight = engine.module.up.weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if topology.tp_rank == 1 and step[0] == INF_STEP:
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad

    weight.register_hook(hook)


def _overflow_run(rank: int, world: int, stage: int, fp16: bool) -> dict:
    topology = Topology.build(MeshShape(tensor=2, data=world // 2))
    extra = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}} if fp16 else {}
    engine = tp_engine(topology, engine_config(stage, "adamw", **extra))
    step = [0]
    _poison_on_tensor_rank_1(engine, topology, step)
    dp = topology.dp_rank
    applied, scales, norms = [], [], []
    for i, (x, y) in enumerate(batches(MB * topology.dp_world_size)):
        step[0] = i
        rows = slice(dp * MB, (dp + 1) * MB)
        dtype = next(engine.module.parameters()).dtype
        engine.backward(F.mse_loss(engine(x[rows].to(dtype)).float(), y[rows]))
        engine.step()
        applied.append(engine.was_step_applied())
        scales.append(engine.get_loss_scale() if fp16 else 1.0)
        norms.append(engine.get_global_grad_norm())
    engine.states.wait_params()  # direct reads below: land pending parameter gathers first
    up = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if n.startswith("norm")}
    return {"applied": applied, "scales": scales, "norms": norms, "skipped": engine.skipped_steps, "norm": up}


@pytest.mark.parametrize("stage", [0, pytest.param(2, marks=pytest.mark.slow), 3])
def test_fp16_inf_on_one_tensor_rank_skips_everywhere_and_lowers_the_scale(dist_run, stage: int) -> None:
    results = dist_run(_overflow_run, 2, stage, True)
    expected_applied = [i != INF_STEP for i in range(len(results[0]["applied"]))]
    for r in results:
        assert r["applied"] == expected_applied
        assert r["skipped"] == 1
        assert r["scales"][INF_STEP] == r["scales"][INF_STEP - 1] / 2  # lowered once, on every rank
        assert not math.isfinite(r["norms"][INF_STEP])
    assert results[0]["scales"] == results[1]["scales"]
    for name, value in results[0]["norm"].items():  # replicated parameters stayed identical on both tensor ranks
        torch.testing.assert_close(value, results[1]["norm"][name], rtol=0, atol=0, msg=name)


def test_fp32_inf_on_one_tensor_rank_skips_everywhere(dist_run) -> None:
    results = dist_run(_overflow_run, 2, 1, False)
    for r in results:
        assert r["applied"] == [i != INF_STEP for i in range(len(r["applied"]))]
        assert r["skipped"] == 1
    for name, value in results[0]["norm"].items():
        torch.testing.assert_close(value, results[1]["norm"][name], rtol=0, atol=0, msg=name)


def _clear_on_tensor_rank_1(rank: int, world: int) -> None:
    topology = Topology.build(MeshShape(tensor=2, data=world // 2))
    engine = tp_engine(topology, engine_config(0, "adamw"))
    x, y = batches(MB)[0]
    engine.backward(F.mse_loss(engine(x), y))
    if topology.tp_rank == 1:
        engine.module.zero_grad()  # only this tensor rank: it would step on zero gradients, the other not
    engine.step()


def test_gradient_clearings_agreed_across_tensor_ranks(dist_run) -> None:
    with pytest.raises(RankFailure) as failure:
        dist_run(_clear_on_tensor_rank_1, 2)
    assert sorted(failure.value.errors) == [0, 1]  # the same error on every rank, not a hang or a silent step
    for message in failure.value.messages():
        assert "gradients were cleared" in message and "between 0 and 1 times across the ranks" in message
