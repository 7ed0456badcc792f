"""Collective-order verification on real ranks (gloo, world 2): divergent control flow raises on every rank naming
both calls instead of hanging or mixing tensors; the "skip the bad batch" loop is caught at the first mismatched
collective; the check changes nothing but time; off, nothing extra is logged ([Note: collective-order
verification] in comm/order_check.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parity import TinyNet, global_batches, make_model, rank_slice

import shardspeed
from harness import error_of
from shardspeed.comm import Collectives
from shardspeed.comm.order_check import ENV_VAR
from shardspeed.config import load_config
from shardspeed.engine_setup import engine_collectives
from shardspeed.topology import AxisGroup, Topology

FAST_S = 10.0  # generous: a verified mismatch costs two tiny exchanges; the harness's hang backstop is 30 s


def _world(rank: int) -> AxisGroup:
    return AxisGroup("data", dist.group.WORLD, (0, 1), rank)


def _diverge(rank: int, world: int, kind: str) -> dict:
    """Both ranks issue a few agreed collectives, then rank 1 diverges (``kind``); every rank reports its error."""
    collectives = Collectives(verify_order=True)
    axis = _world(rank)
    other = dist.new_group([0, 1])  # every rank creates it (new_group is world-collective)
    t = torch.full((4,), float(rank + 1))
    collectives.all_reduce(t, axis)  # agreed
    assert t.tolist() == [3.0] * 4

    def diverging() -> None:
        if kind == "extra" and rank == 1:
            collectives.all_reduce(torch.ones(4), axis, tag="extra")  # LINE:extra
        if kind == "dtype":
            collectives.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32), axis)
        if kind == "shape":
            collectives.all_reduce(torch.ones(4 + rank), axis)
        if kind == "group":
            collectives.all_reduce(torch.ones(4), AxisGroup("tensor", other, (0, 1), rank) if rank else axis)
        collectives.all_reduce(torch.ones(4), axis, tag="final")  # LINE:final

    start = time.monotonic()
    error = error_of(diverging)
    return {"error": error, "seconds": time.monotonic() - start, "checked": collectives.order.checked}


def _line(marker: str) -> int:
    source = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, text in enumerate(source) if text.rstrip().endswith(f"# LINE:{marker}"))


@pytest.mark.parametrize("kind", ["extra", "dtype", "shape", "group"])
def test_divergent_collectives_raise_on_both_ranks_naming_both_calls(dist_run, kind: str) -> None:
    results = dist_run(_diverge, 2, kind)
    errors = [r["error"] for r in results]
    assert all(e.startswith("CollectiveOrderError: collective order diverged between ranks 0 and 1") for e in errors)
    assert errors[0] == errors[1], "every member gets the same message"
    assert all(r["seconds"] < FAST_S for r in results)
    rank0, rank1 = errors[0].split("\n  rank 0: ")[1].split("\n  rank 1: ")
    if kind == "extra":  # rank 0 is already at the final all-reduce, rank 1 at its extra one
        assert f"dist/test_collective_order.py:{_line('final')} diverging" in rank0 and "tag='final'" in rank0
        assert f"dist/test_collective_order.py:{_line('extra')} diverging" in rank1 and "tag='extra'" in rank1
    elif kind == "dtype":
        assert "all_reduce(sum) float32[4]" in rank0 and "all_reduce(sum) float64[4]" in rank1
    elif kind == "shape":
        assert "float32[4] on" in rank0 and "float32[5] on" in rank1
    else:
        assert "on data[0, 1]" in rank0 and "on tensor[0, 1]" in rank1
    assert all(" as call #" in side and " at dist/test_collective_order.py:" in side for side in (rank0, rank1))


def _every_op_agreed(rank: int, world: int) -> dict:
    """Every Collectives method, async ones included, gives the same results verified as unverified."""
    axis = _world(rank)
    out = {}
    for verify in (False, True):
        c = Collectives(verify_order=verify)
        a = torch.arange(4.0) + rank
        c.all_reduce(a, axis, async_op=True).wait()
        m = torch.tensor([float(rank)])
        c.all_reduce_max(m, axis)
        full = torch.empty(4)
        c.all_gather(full, torch.tensor([rank, rank + 0.5]), axis, async_op=True).wait()
        shard = torch.empty(2)
        c.reduce_scatter(shard, torch.arange(4.0) * (rank + 1), axis).wait()
        b = torch.tensor([rank + 7.0])
        c.broadcast(b, axis, 1)
        objs = c.all_gather_object({"rank": rank}, axis)
        out[verify] = [a, m, full, shard, b, objs]
        if verify:
            out["checked"] = c.order.checked
    return out


def test_every_verified_op_gives_the_same_result(dist_run) -> None:
    for r in dist_run(_every_op_agreed, 2):
        assert r["checked"] == 6
        for off, on in zip(r[False], r[True]):
            assert torch.equal(off, on) if isinstance(off, torch.Tensor) else off == on


class Flaky(TinyNet):
    """TinyNet whose forward raises on a marked batch after its first layer ran (ZeRO-3: after a unit gather)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if bool(torch.isnan(x).any()):
            raise ValueError("bad batch")
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid2(h))
        return self.out(h)


def _config(stage: int, verify: bool, comms: bool = False, propagate: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
        "fault_tolerance": {"verify_collective_order": verify, "propagate_failures": propagate},
        "comms_logger": {"enabled": comms},
        "steps_per_print": 1000,
    }


def _skip_bad_batch(rank: int, world: int, stage: int, ckpt: str) -> dict:
    """The issue's loop: rank 1's forward raises on one batch, the loop catches it and goes on; then both save.
    Failure propagation is off: with it on, rank 1's forward publishes its exception and every rank raises
    PeerFailedError before any collective could pair off (tests/dist/test_failure_propagation.py); here the order
    check alone must catch the divergence."""
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=Flaky(), config=_config(stage, verify=True, propagate=False))

    def loop() -> None:
        for step, (x, y) in enumerate(global_batches(3, 8)):
            for m in range(2):
                xs = rank_slice(x, m, rank, world, 2)
                if rank == 1 and step == 1 and m == 0:
                    xs = xs.clone().fill_(float("nan"))
                try:
                    loss = F.mse_loss(engine(xs), rank_slice(y, m, rank, world, 2))
                except ValueError:
                    continue  # "skip the bad batch"
                engine.backward(loss)
                engine.step()
        engine.save_checkpoint(ckpt)

    start = time.monotonic()
    error = error_of(loop)
    return {"error": error, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_skip_the_bad_batch_is_caught_at_the_first_mismatched_collective(dist_run, tmp_path, stage: int) -> None:
    results = dist_run(_skip_bad_batch, 2, stage, str(tmp_path / "ckpt"))
    errors = [r["error"] for r in results]
    assert errors[0].startswith("CollectiveOrderError: collective order diverged between ranks 0 and 1"), errors
    assert errors[0] == errors[1]
    assert all(r["seconds"] < 60 for r in results)  # generous: includes three training steps on a loaded machine
    rank0, rank1 = errors[0].split("\n  rank 0: ")[1].split("\n  rank 1: ")
    if stage == 0:
        # Rank 1 skipped a micro-batch, so it reaches the save while rank 0 still reduces its last gradients.
        assert "tag='grads'" in rank0 and "shardspeed/zero/grad_sync.py" in rank0
        assert "all_gather_object" in rank1 and "shardspeed/checkpoint/" in rank1
    else:
        # Rank 1's forward raised after one unit: its next forward gathers another unit than rank 0 does.
        assert "all_gather float32[21], [42] tag='params'" in rank0
        assert "all_gather float32[52], [104] tag='params'" in rank1
        assert all("shardspeed/zero/stage3/unit.py" in side for side in (rank0, rank1))
    assert not (tmp_path / "ckpt" / "latest").exists()


def _train(rank: int, world: int, stage: int, verify: bool) -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config(stage, verify, comms=True))
    norms = []
    for x, y in global_batches(2, 8):
        for m in range(2):
            loss = F.mse_loss(engine(rank_slice(x, m, rank, world, 2)), rank_slice(y, m, rank, world, 2))
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    full = engine.module_state_dict()
    order = engine.collectives.order
    return {
        "params": {n: full[n].clone() for n, _ in engine.module.named_parameters()},
        "norms": norms,
        # the traffic figures (latencies are wall time and differ between runs)
        "log": {k: (v.count, v.elements, v.bytes, v.algorithmic_elements) for k, v in engine.comms_log.totals.items()},
        "checked": None if order is None else order.checked,
    }


def _on_then_off(rank: int, world: int, stage: int) -> dict:
    return {"on": _train(rank, world, stage, True), "off": _train(rank, world, stage, False)}


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "stage", [pytest.param(0, marks=SLOW), pytest.param(1, marks=SLOW), pytest.param(2, marks=SLOW), 3]
)
def test_verified_training_is_bitwise_identical_and_logs_nothing_extra(dist_run, stage: int) -> None:
    for r in dist_run(_on_then_off, 2, stage):
        on, off = r["on"], r["off"]
        assert on["norms"] == off["norms"]
        assert all(torch.equal(on["params"][n], off["params"][n]) for n in off["params"])
        assert on["log"] == off["log"] and off["log"], "the order checks' exchanges are not comms-log traffic"
        assert off["checked"] is None and on["checked"] > 10


def _env_flag(rank: int, world: int) -> list[str]:
    """Rank 1 alone sets the variable (refused on both ranks), then both do (verification on)."""
    errors = []
    for ranks_on in ((1,), (0, 1)):
        if rank in ranks_on:
            os.environ[ENV_VAR] = "1"
        try:
            errors.append(error_of(lambda: _check_env_engine(rank)))
        finally:
            os.environ.pop(ENV_VAR, None)
    return errors


def _check_env_engine(rank: int) -> None:
    # What the engine builds its Collectives with (the engine's own use of it: the bitwise test's "checked").
    config = load_config(_config(0, verify=False), dp_world_size=2)
    collectives = engine_collectives(config, Topology.build())
    assert collectives.order is not None, "SHARDSPEED_VERIFY_COLLECTIVES=1 turns verification on"


def test_env_var_turns_it_on_and_must_agree(dist_run) -> None:
    (mismatch0, on0), (mismatch1, on1) = dist_run(_env_flag, 2)
    assert on0 == on1 == "no error"
    assert mismatch0 == mismatch1
    assert mismatch0.startswith("ValueError: collective-order verification is on for ranks [1] but off for ranks [0]")


def _checkpoint_round_trip(rank: int, world: int, stage: int, ckpt: str) -> dict:
    """Save, load into a fresh engine (before its first backward: stages 1/2 relayout), train on: all verified."""
    first, *_ = shardspeed.initialize(model=make_model(), config=_config(stage, verify=True))
    for x, y in global_batches(2, 8):
        for m in range(2):
            first.backward(F.mse_loss(first(rank_slice(x, m, rank, world, 2)), rank_slice(y, m, rank, world, 2)))
            first.step()
    first.save_checkpoint(ckpt)
    second, *_ = shardspeed.initialize(model=make_model(seed=5), config=_config(stage, verify=True))
    second.load_checkpoint(ckpt)
    loaded = {n: p.clone() for n, p in second.module_state_dict().items()}
    x, y = global_batches(1, 8, seed=7)[0]
    second.backward(F.mse_loss(second(rank_slice(x, 0, rank, world, 2)), rank_slice(y, 0, rank, world, 2)))
    second.step()
    return {"saved": first.module_state_dict(), "loaded": loaded, "checked": second.collectives.order.checked}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_round_trip_passes_verification(dist_run, tmp_path, stage: int) -> None:
    for r in dist_run(_checkpoint_round_trip, 2, stage, str(tmp_path / "ckpt")):
        assert all(torch.equal(r["saved"][n], r["loaded"][n]) for n in r["saved"])
        assert r["checked"] > 5
