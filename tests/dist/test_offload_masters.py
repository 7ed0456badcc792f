"""Mixed precision with a streamed offload optimizer: the fp32 masters live only in the optimizer's store (NVMe
here), never in host memory beside it. Training equals the same stage without offload; checkpoints hold the fp32
masters (the same bytes a run without offload saves) and resume exactly; frozen parameters and GatheredParameters
edits keep working."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parity import full_params, global_batches, make_model, offload_engine, train_engine

import shardspeed
from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

MB, GAS = 2, 2


def _engine(
    stage: int,
    tmp: str | None,
    *,
    param_offload: bool = False,
    ratio: float = 1.0,
    frozen: bool = False,
    bf16: bool = True,
    only_out: bool = False,
):
    """``only_out``: only the ``out`` layer goes to the optimizer; the other layers still require grad (as in
    DeepSpeed they are then never updated)."""
    model = make_model(frozen=frozen)
    zero: dict = {"stage": stage, "reduce_bucket_size": 100}
    if tmp is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "opt"), "ratio": ratio}
        if param_offload:
            zero["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "param"), "max_in_cpu": 0}
    params = list(model.out.parameters()) if only_out else None
    return offload_engine(zero, bf16=bf16, model=model, params=params, mb=MB, gas=GAS)


def _masters_run(rank: int, world: int, stage: int, tmp: str, param_offload: bool, ratio: float, frozen: bool) -> dict:
    batches = global_batches(5, MB * GAS * world)
    out: dict = {}
    for label in ("plain", "offloaded"):
        engine = _engine(
            stage, None if label == "plain" else tmp, param_offload=param_offload, ratio=ratio, frozen=frozen
        )
        train_engine(engine, rank, world, batches[:3], MB, GAS)
        engine.save_checkpoint(os.path.join(tmp, f"ckpt-{label}"))
        out[f"{label}_bf16_at_save"] = full_params(engine)
        train_engine(engine, rank, world, batches[3:], MB, GAS)
        out[label] = full_params(engine)
        breakdown = engine.memory_breakdown()
        out[f"{label}_master_bytes"] = breakdown.get("master_shard", 0) + breakdown.get("master", 0)
        out[f"{label}_state_bytes"] = breakdown["optimizer_states"]
        engine.destroy()
    for label, source in (("resumed", "offloaded"), ("plain_from_offloaded", "offloaded")):
        engine = _engine(stage, tmp if label == "resumed" else None, param_offload=param_offload, ratio=ratio,
                         frozen=frozen)  # fmt: skip
        engine.load_checkpoint(os.path.join(tmp, f"ckpt-{source}"))
        train_engine(engine, rank, world, batches[3:], MB, GAS)
        out[label] = full_params(engine)
        engine.destroy()
    return out


CASES = [
    (1, False, 1.0, False),
    (2, False, 1.0, False),
    (2, False, 0.5, False),  # half the masters stay in memory (ratio), half in the store
    (3, False, 1.0, True),  # frozen parameter: its checkpoint value is the upcast shard
    (3, True, 1.0, False),  # parameter shards on NVMe too
    (3, True, 0.5, True),
]


@pytest.mark.parametrize(("stage", "param_offload", "ratio", "frozen"), CASES)
def test_masters_in_the_store(dist_run, tmp_path: Path, stage: int, param_offload: bool, ratio: float, frozen: bool):
    results = dist_run(_masters_run, 2, stage, str(tmp_path), param_offload, ratio, frozen)
    for r in results:
        for name, p in r["plain"].items():
            for label in ("offloaded", "resumed", "plain_from_offloaded"):
                assert (r[label][name] - p).abs().max().item() <= 1e-6, (label, name)
        assert r["plain_master_bytes"] > 0 and r["offloaded_master_bytes"] == 0  # no fp32 master beside the store
        if ratio == 1.0:
            assert r["offloaded_state_bytes"] == 0
    # the checkpoint holds the fp32 masters, what the run without offload saved (up to the fused CPU kernel's
    # rounding), not the bf16 parameters (those differ by bf16's rounding, ~1e-4 here)
    ours = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt-offloaded")
    theirs = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt-plain")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert (ours[name] - theirs[name]).abs().max().item() <= 1e-6, name
    bf16 = results[0]["offloaded_bf16_at_save"]
    assert max((ours[n].view(-1) - bf16[n].view(-1)).abs().max().item() for n in ours) > 1e-5


def _edit(rank: int, world: int, tmp: str, param_offload: bool, bf16: bool) -> dict:
    out = {}
    for label in ("plain", "offloaded"):
        engine = _engine(3, None if label == "plain" else tmp, param_offload=param_offload, bf16=bf16)
        train_engine(engine, rank, world, global_batches(1, MB * GAS * world), MB, GAS)
        with shardspeed.zero.GatheredParameters([engine.module.mid.weight], modifier_rank=0):
            if rank == 0:
                engine.module.mid.weight.data.fill_(0.25)
        train_engine(engine, rank, world, global_batches(1, MB * GAS * world, seed=5), MB, GAS)
        out[label] = full_params(engine)
        engine.destroy()
    return out


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-masters", "fp32-values"])
@pytest.mark.parametrize("param_offload", [False, True])
def test_gathered_parameters_edit_reaches_the_values_in_the_store(
    dist_run, tmp_path: Path, param_offload: bool, bf16: bool
):
    """The streamed optimizer steps from the fp32 values in its store (bf16: the masters; fp32: the values
    themselves), so an edit must reach the store, or the next step writes the old values back over it."""
    for r in dist_run(_edit, 2, str(tmp_path), param_offload, bf16):
        weight = r["offloaded"]["mid.weight"]
        assert (weight - 0.25).abs().max().item() < 0.2  # one step from the edit, not from the old masters
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name


def _partial(rank: int, world: int, stage: int, tmp: str) -> dict:
    out: dict = {}
    for label in ("plain", "offloaded"):
        engine = _engine(stage, None if label == "plain" else tmp, only_out=True)
        train_engine(engine, rank, world, global_batches(2, MB * GAS * world), MB, GAS)
        engine.save_checkpoint(os.path.join(tmp, f"ckpt-{label}"))
        out[label] = full_params(engine)
        engine.destroy()
    engine = _engine(stage, tmp, only_out=True)
    engine.load_checkpoint(os.path.join(tmp, "ckpt-plain"))
    out["loaded"] = full_params(engine)
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_trainable_parameters_left_out_of_the_optimizer(dist_run, tmp_path: Path, stage: int) -> None:
    """Parameters that require grad but were not passed to initialize() are never stepped; with the masters in
    the store their checkpoint values are their (unchanged) parameters, and such checkpoints load."""
    for r in dist_run(_partial, 2, stage, str(tmp_path)):
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name
            assert (r["loaded"][name] - p).abs().max().item() <= 1e-6, name
    ours = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt-offloaded")
    theirs = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt-plain")
    for name in theirs:
        assert theirs[name].abs().max().item() > 0, name
        assert (ours[name] - theirs[name]).abs().max().item() <= 1e-6, name
