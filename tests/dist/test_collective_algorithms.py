"""[Note: collective algorithms]: reduce-scatter as all-reduce-then-slice and all-gather as per-owner broadcasts give
the native op's exact bits, wait through the failure board, are agreed by calibration across ranks, and leave
ZeRO's numbers and traffic figures unchanged."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parity import full_params, global_batches, make_model, optimizer_config, reference_run, train_engine

import shardspeed
from shardspeed.comm import Collectives, CommsLog
from shardspeed.comm.algorithms import NATIVE, CollectiveChoice, SizeRule, table_choice, to_json
from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.faults.errors import PeerFailedError
from shardspeed.faults.process import failure_board
from shardspeed.topology import AxisGroup

ALTERNATIVES = CollectiveChoice(
    reduce_scatter=(SizeRule(None, "all_reduce"),), all_gather=(SizeRule(None, "broadcast"),), source="test"
)


def _axis(rank: int, world: int) -> AxisGroup:
    return AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)


def _bits(rank: int, world: int) -> dict[str, Any]:
    """Every (dtype, shard size, clobber) case: native and the alternatives on the same inputs."""
    axis, c = _axis(rank, world), Collectives(CommsLog(enabled=True))
    mismatches, untouched = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 1000):  # shard sizes: odd, so nothing divides evenly into nice chunks
            g = torch.Generator().manual_seed(10 * rank + n)
            full = torch.randn(n * world, generator=g).to(dtype)
            shard = torch.randn(n, generator=g).to(dtype)
            for clobber in (False, True):
                c.algorithms = NATIVE
                rs_native, ag_native = torch.empty(n, dtype=dtype), torch.empty(n * world, dtype=dtype)
                c.reduce_scatter(rs_native, full.clone(), axis)
                c.all_gather(ag_native, shard, axis)
                c.algorithms = ALTERNATIVES
                rs, ag, source = torch.empty(n, dtype=dtype), torch.empty(n * world, dtype=dtype), full.clone()
                c.reduce_scatter(rs, source, axis, async_op=True, clobber_input=clobber).wait()
                c.all_gather(ag, shard, axis, async_op=True).wait()
                case = (str(dtype), n, clobber)
                if not (torch.equal(rs, rs_native) and torch.equal(ag, ag_native)):
                    mismatches.append(case)
                if not clobber:
                    untouched.append(torch.equal(source, full))
    # the comms log keeps the logical ops with their ring traffic whatever carried them
    totals = {k: (t.count, t.elements) for k, t in c.log.totals.items()}
    return {"mismatches": mismatches, "untouched": all(untouched), "counts": dict(c.algorithm_counts), "log": totals}


@pytest.mark.parametrize("world", [2, 4])
def test_alternatives_are_bit_identical_to_native(dist_run, world: int) -> None:
    for result in dist_run(_bits, world):
        assert result["mismatches"] == []
        assert result["untouched"]  # without clobber_input the input is left as it was
        cases = 2 * 3 * 2
        assert result["counts"] == {
            "reduce_scatter=native": cases,
            "all_gather=native": cases,
            "reduce_scatter=all_reduce": cases,
            "all_gather=broadcast": cases,
        }
        calls, numel = 2 * cases, 2 * 2 * 2 * (1 + 7 + 1000) * world  # native + alternative; dtype × clobber × algo
        assert result["log"] == {"reduce_scatter": (calls, numel), "all_gather": (calls, numel)}


def _composite_work(rank: int, world: int) -> dict[str, Any]:
    axis, c = _axis(rank, world), Collectives()
    c.algorithms = ALTERNATIVES
    out, shard = torch.zeros(4 * world), torch.full((4,), float(rank))
    work = c.all_gather(out, shard, axis, async_op=True, tag="params")
    work.wait()
    work.wait()  # idempotent: nothing waited, nothing recorded the second time
    return {"out": out.tolist(), "waits": dict(c.blocked.waits), "done": work.done()}


def test_composite_work_is_one_wait_of_the_logical_op(dist_run) -> None:
    for result in dist_run(_composite_work, 2):
        assert result["out"] == [0.0] * 4 + [1.0] * 4
        assert result["waits"] == {"all_gather:params": 1}  # recorded under the logical op, once
        assert result["done"]


def _peer_fails(rank: int, world: int, op: str) -> Any:
    board = failure_board(FaultToleranceConfig(watch_interval_s=0.1))
    c = Collectives(CommsLog(), board)
    c.algorithms = ALTERNATIVES
    if rank == 1:  # fails before its broadcast / all-reduce: what the engine's guard does with an exception
        board.publish("step", RuntimeError("optimizer exploded on rank 1"))
        return None
    axis, start = _axis(rank, world), time.monotonic()
    try:
        if op == "all_gather":
            c.all_gather(torch.zeros(8), torch.ones(4), axis, async_op=True, tag="params").wait()
        else:
            c.reduce_scatter(torch.zeros(4), torch.ones(8), axis, async_op=True, tag="grads").wait()
    except PeerFailedError as exc:
        return str(exc), time.monotonic() - start, dict(c.blocked.waits)
    return "no error", 0.0, {}


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_peer_failure_interrupts_a_composite_wait(dist_run, op: str) -> None:
    (message, waited, waits), _ = dist_run(_peer_fails, 2, op, deadline_s=30.0)
    assert "rank 1" in message and "optimizer exploded on rank 1" in message
    tag = "params" if op == "all_gather" else "grads"
    assert f"waiting in {op} '{tag}' over the data axis" in message
    assert waited < 10.0
    assert waits == {f"{op}:{tag}": 1}


def _calibration(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from shardspeed.comm import calibrate

    calibrate.LADDER_BYTES, calibrate.REPS = (4096, 65536), 2  # a short ladder: the agreement is under test
    os.environ["SHARDSPEED_CACHE_DIR"] = os.path.join(tmp, f"host{rank}")  # one cache per "host"
    axis, c = _axis(rank, world), Collectives()
    key = calibrate.cache_key("gloo", world, torch.float32)
    path = calibrate.cache_file(calibrate.cache_dir(None), key)
    theirs = table_choice("gloo", world) if rank == 0 else ALTERNATIVES  # the hosts' caches differ
    calibrate.store_cached(path, theirs, key)
    auto = calibrate.resolve_choice("auto", None, c, axis, torch.float32)
    calibrated = calibrate.resolve_choice("calibrate", None, c, axis, torch.float32)
    cached = calibrate.load_cached(path, key)
    again = calibrate.resolve_choice("auto", None, c, axis, torch.float32)
    native = calibrate.resolve_choice("native", None, c, axis, torch.float32)
    return {
        "auto": auto.source,
        "calibrated": to_json(calibrated, {}),
        "calibrated_source": calibrated.source,
        "cache_now": cached is not None and to_json(cached, {}) == to_json(calibrated, {}),
        "again": (again.source, to_json(again, {}) == to_json(calibrated, {})),
        "native": native == NATIVE,
        "counts": dict(c.algorithm_counts),
    }


def test_calibration_is_agreed_when_caches_differ(dist_run, tmp_path) -> None:
    results = dist_run(_calibration, 2, str(tmp_path))
    for r in results:
        assert r["auto"].startswith("table")  # caches that differ between ranks are not used
        assert r["calibrated_source"] == "calibration"
        assert r["cache_now"]  # every rank cached the decision
        assert r["again"] == ("cache", True)  # now every rank holds the same cache: used
        assert r["native"]
        assert r["counts"] == {}  # the measurement leaves the job's counters alone
    assert results[0]["calibrated"] == results[1]["calibrated"]  # rank 0's decision, timings included


# --- ZeRO with the table's choice (and every alternative) against native ------------------------------------------
MB, STEPS, LR, CLIP = 2, 5, 0.05, 0.5


def _zero_run(rank: int, world: int, stage: int, kind: str, wire: str | None = None) -> dict[str, Any]:
    batches = global_batches(STEPS, MB * world)
    out: dict[str, Any] = {}
    for name, mode, force in (("native", "native", None), ("table", "auto", None), ("all", "native", ALTERNATIVES)):
        model = make_model()
        config = {
            "train_micro_batch_size_per_gpu": MB,
            "gradient_accumulation_steps": 1,
            "optimizer": optimizer_config(kind, LR),
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage},
            "communication": {"collectives": mode},
            "comms_logger": {"enabled": True},
            "steps_per_print": 1000,
            **({"communication_data_type": wire} if wire else {}),
        }
        engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if force is not None:
            engine.collectives.algorithms = force
        train_engine(engine, rank, world, batches, MB, 1)
        out[name] = {
            "params": full_params(engine),
            "log": {k: (t.count, t.elements, t.algorithmic_elements) for k, t in engine.comms_log.totals.items()},
            "counts": dict(engine.collectives.algorithm_counts),
            "source": engine.collectives.algorithms.source,
        }
        engine.destroy()
    return out


@pytest.mark.parametrize(
    ("stage", "kind", "wire"),
    [
        (1, "adamw", None),
        (2, "adamw", None),
        (3, "adamw", None),
        (1, "adamw", "bf16"),  # a wire-dtype staging copy instead of the buffer itself ([Note: clobbered inputs])
        pytest.param(2, "sgd", None, marks=pytest.mark.slow),
        pytest.param(2, "adamw", "bf16", marks=pytest.mark.slow),
    ],
)
def test_zero_parity_and_traffic_under_every_algorithm(dist_run, stage: int, kind: str, wire: str | None) -> None:
    expected, _ = reference_run(kind, LR, CLIP, global_batches(STEPS, MB * 2))
    for result in dist_run(_zero_run, 2, stage, kind, wire):
        native = result["native"]
        assert result["table"]["source"].startswith("table")
        assert result["table"]["counts"].get("reduce_scatter=all_reduce", 0) > 0  # world 2's table: all-reduce
        assert result["all"]["counts"].get("all_gather=broadcast", 0) > 0
        # set after construction: what construction gathered ran native; every step's reduction and gather not
        assert result["all"]["counts"].get("reduce_scatter=all_reduce", 0) > 0
        assert result["all"]["counts"].get("reduce_scatter=native", 0) == 0
        for name in ("table", "all"):
            assert result[name]["log"] == native["log"]  # the paper's traffic figures whatever carried them
            for n, p in native["params"].items():
                assert torch.equal(result[name]["params"][n], p), (name, n)  # bit-identical to native
        if wire is None:  # a bf16 wire rounds the gradients: bit-identity to native is the check there
            for n, p in native["params"].items():
                torch.testing.assert_close(p, expected[n], rtol=1e-5, atol=1e-5)


def _in_place(rank: int, world: int) -> dict[str, Any]:
    """A shard that is this rank's own slot of the collective's other tensor (stage 1's reduced gradient slice, the
    stepped parameter slice), under every algorithm: the same bits as out-of-place calls, the slot left holding the
    result, and an in-place reduce-scatter without clobber_input refused."""
    axis, c = _axis(rank, world), Collectives()
    n, wrong, refused = 5, [], False
    g = torch.Generator().manual_seed(rank)
    full, mine = torch.randn(n * world, generator=g), torch.randn(n, generator=g)
    for choice in (NATIVE, ALTERNATIVES):
        c.algorithms = choice
        expected_rs, expected_ag = torch.empty(n), torch.empty(n * world)
        c.reduce_scatter(expected_rs, full.clone(), axis)
        c.all_gather(expected_ag, mine, axis)
        buffer = full.clone()
        slot = buffer[rank * n : (rank + 1) * n]
        c.reduce_scatter(slot, buffer, axis, async_op=True, clobber_input=True).wait()
        gathered = torch.zeros(n * world)
        gathered[rank * n : (rank + 1) * n] = mine
        c.all_gather(gathered, gathered[rank * n : (rank + 1) * n], axis, async_op=True).wait()
        if not (torch.equal(slot, expected_rs) and torch.equal(gathered, expected_ag)):
            wrong.append(choice.source)
    c.algorithms = NATIVE
    buffer = full.clone()
    try:
        c.reduce_scatter(buffer[rank * n : (rank + 1) * n], buffer, axis)
    except ValueError as err:
        refused = "clobber_input" in str(err)
    return {"wrong": wrong, "refused": refused}


def test_in_place_shards_under_every_algorithm(dist_run) -> None:
    for r in dist_run(_in_place, 2):
        assert r == {"wrong": [], "refused": True}
