"""ZeRO communication: bucketed and overlapped with backward; traffic per step against the paper's 2Ψ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice

import shardspeed


def _config(gas: int, bucket: int, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket},
        "comms_logger": {"enabled": True},
        "steps_per_print": 1000,
        **extra,
    }


def _comm_per_micro_step(rank: int, world: int) -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2, 100))
    seen_at_first_layer = []
    # The input layer's gradients are the last to be computed; by then earlier buckets must already be in flight.
    model.inp.register_full_backward_pre_hook(
        lambda *_: seen_at_first_layer.append(engine.comms_log.totals["all_reduce:grads"].count)
    )
    x, y = global_batches(1, 2 * 2 * world)[0]
    counts = []
    for m in range(2):
        engine.backward(F.mse_loss(engine(rank_slice(x, m, rank, world, 2)), rank_slice(y, m, rank, world, 2)))
        counts.append(engine.comms_log.totals["all_reduce:grads"].count)
        engine.step()
    log = engine.comms_log.totals["all_reduce:grads"]
    numel = sum(p.numel() for p in model.parameters())
    return {
        "counts": counts,
        "buckets": len(engine.states.layout.buckets),
        "elements": log.elements,
        "algo": log.algorithmic_elements,
        "numel": numel,
        "seen_at_first_layer": seen_at_first_layer,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_bucketed_allreduce_only_on_boundary_and_overlapped(dist_run, world: int) -> None:
    for r in dist_run(_comm_per_micro_step, world):
        assert r["buckets"] > 2
        assert r["counts"] == [0, r["buckets"]]  # nothing on the non-boundary micro-step
        assert r["elements"] == r["numel"]
        assert r["algo"] == pytest.approx(2 * (world - 1) / world * r["numel"])
        assert r["seen_at_first_layer"][1] >= 1  # a bucket launched before backward reached the first layer


def _no_sync_then_step(rank: int, world: int) -> str:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1, 10**6))
    x, y = global_batches(1, 2 * world)[0]
    with engine.no_sync():
        engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, 2)), rank_slice(y, 0, rank, world, 2)))
    assert engine.comms_log.totals["all_reduce:grads"].count == 0
    try:
        engine.step()
    except RuntimeError as err:
        return str(err)
    return "stepped"


def test_step_on_unreduced_gradients_is_an_error(dist_run) -> None:
    for message in dist_run(_no_sync_then_step, 2):
        assert "never all-reduced" in message and "no_sync" in message


def _comm_dtype(rank: int, world: int) -> dict:
    model = make_model()
    config = _config(1, 10**6, communication_data_type="bf16")
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = global_batches(1, 2 * world)[0]
    engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, 2)), rank_slice(y, 0, rank, world, 2)))
    log = engine.comms_log.totals["all_reduce:grads"]
    return {"bytes": log.bytes, "elements": log.elements, "grad": engine.states.grad_buffer.flat.clone()}


def test_communication_data_type_bf16(dist_run) -> None:
    results = dist_run(_comm_dtype, 2)
    assert results[0]["bytes"] == 2 * results[0]["elements"]
    assert torch.equal(results[0]["grad"], results[1]["grad"])


def _mismatched_models(rank: int, world: int) -> str:
    model = make_model(unused=(rank == 1))
    try:
        shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1, 100))
    except ValueError as err:
        return str(err)
    return "no error"


def test_model_mismatch_between_ranks_is_an_error_on_every_rank(dist_run) -> None:
    for message in dist_run(_mismatched_models, 2):
        assert "model structure differs between ranks 0 and 1" in message


def _traffic(rank: int, world: int, stage: int, gas: int) -> dict:
    model = make_model()
    config = _config(gas, 100, zero_optimization={"stage": stage, "reduce_bucket_size": 100})
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.comms_log.reset()  # drop the one-off parameter broadcast at start-up
    x, y = global_batches(1, 2 * gas * world)[0]
    for m in range(gas):
        engine.backward(F.mse_loss(engine(rank_slice(x, m, rank, world, 2)), rank_slice(y, m, rank, world, 2)))
        engine.step()
    log = engine.comms_log
    return {
        "psi": engine.states.layout.total,
        "bulk": log.algorithmic_elements("all_reduce:grads")
        + log.algorithmic_elements("reduce_scatter:grads")
        + log.algorithmic_elements("all_gather:params"),
        "total": log.algorithmic_elements(),
        "ops": sorted(log.totals),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_traffic_per_step_is_two_psi(dist_run, world: int, stage: int) -> None:
    """GAS 1: every stage moves 2·Ψ_padded·(N−1)/N per rank per step (all-reduce, or reduce-scatter + all-gather)."""
    for r in dist_run(_traffic, world, stage, 1):
        expected = 2 * r["psi"] * (world - 1) / world
        assert r["bulk"] == pytest.approx(expected, rel=1e-9)
        assert r["total"] == pytest.approx(expected, rel=0.02)  # the step-checks all-reduce (4 floats) aside
        if stage > 0:
            # no clipping configured: the norm (one scalar all-reduce) is skipped; the step checks (unused
            # parameters, gradient clearings agreed across ranks) are one 4-float all-reduce
            assert r["ops"] == ["all_gather:params", "all_reduce:step_checks", "reduce_scatter:grads"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_traffic_with_gradient_accumulation(dist_run, stage: int) -> None:
    """GAS 3: stages 0/1 reduce once per step; stage 2 reduce-scatters every micro-step into the shards, so it
    moves (GAS + 1)·Ψ·(N−1)/N — the price of never holding a full gradient."""
    world, gas = 2, 3
    for r in dist_run(_traffic, world, stage, gas):
        per = r["psi"] * (world - 1) / world
        expected = (gas + 1) * per if stage == 2 else 2 * per
        assert r["bulk"] == pytest.approx(expected, rel=1e-9)


def _data_dependent(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    """mid2 runs only on rank 0 on odd steps: gradients arrive in different orders on different ranks."""
    model = make_model()
    config = _config(1, 60, zero_optimization={"stage": stage, "reduce_bucket_size": 60})
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step, (x, y) in enumerate(global_batches(4, 2 * world)):
        xs, ys = rank_slice(x, 0, rank, world, 2), rank_slice(y, 0, rank, world, 2)
        h = torch.tanh(model.mid(torch.tanh(model.inp(xs))))
        if rank == 0 and step % 2:
            h = torch.tanh(model.mid2(h))
        engine.backward(F.mse_loss(model.out(h), ys))
        engine.step()
    # through the engine: submodules called on their own leave the last step's parameter gathers pending
    # ([Note: overlapped parameter gather]); engine.parameters() waits for them
    return [p.detach().clone() for p in engine.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_unused_on_some_ranks_do_not_hang_or_diverge(dist_run, stage: int) -> None:
    results = dist_run(_data_dependent, 2, stage)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _overlap(rank: int, world: int, overlap: bool) -> dict:
    model = make_model()
    config = _config(1, 60, zero_optimization={"stage": 2, "reduce_bucket_size": 60, "overlap_comm": overlap})
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in global_batches(3, 2 * world):
        engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, 2)), rank_slice(y, 0, rank, world, 2)))
        engine.step()
    biggest = max(b.numel for b in engine.states.layout.buckets) * 4
    return {
        "params": [p.detach().clone() for p in engine.parameters()],  # waits for the last step's gathers
        "peak": engine.memory_breakdown()["peak_bucket_bytes"],
        "biggest_bucket": biggest,
    }


def test_overlap_comm_off_keeps_one_bucket_in_flight_with_same_result(dist_run) -> None:
    on = dist_run(_overlap, 2, True)
    off = dist_run(_overlap, 2, False)
    for a, b in zip(on[0]["params"], off[0]["params"]):
        assert torch.equal(a, b)
    assert off[0]["peak"] == off[0]["biggest_bucket"]
    assert on[0]["peak"] > on[0]["biggest_bucket"]  # overlapped: several buckets staged at once


def _strict_unused(rank: int, world: int, stage: int) -> str:
    model = make_model()
    config = _config(1, 60, zero_optimization={"stage": stage, "ignore_unused_parameters": False})
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = global_batches(1, 2 * world)[0]
    h = torch.tanh(model.mid(torch.tanh(model.inp(rank_slice(x, 0, rank, world, 2)))))
    if rank == 0:
        h = torch.tanh(model.mid2(h))  # mid2 unused on rank 1 only
    engine.backward(F.mse_loss(model.out(h), rank_slice(y, 0, rank, world, 2)))
    with pytest.raises(RuntimeError) as info:
        engine.step()
    return str(info.value)


@pytest.mark.parametrize("stage", [0, 2])
def test_ignore_unused_parameters_false_raises_on_every_rank(dist_run, stage: int) -> None:
    messages = dist_run(_strict_unused, 2, stage)
    assert "another data-parallel rank" in messages[0]
    assert "here: mid2.weight, mid2.bias" in messages[1] or "here: mid2.bias, mid2.weight" in messages[1]
