"""fp32 ZeRO-3 with ``offload_param: nvme`` and ``offload_optimizer: nvme`` equals stage 3 without offload: the
streamed optimizer writes each unit's shard through its store (stand-in stepped tensors), offloaded shards are
not in memory between steps, and checkpoints round-trip to and from engines without offload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from parity import full_params, global_batches, make_model, offload_engine, train_engine

import shardspeed
from harness import error_of

STEPS, MB, GAS, LR = 5, 2, 2, 0.05


def _engine(tmp: str | None, *, threshold: int = 0, frozen: bool = False, two_groups: bool = False):
    model = make_model(frozen=frozen)
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": threshold}
    if tmp is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "params"), "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "opt")}
    params = None
    if two_groups:  # biases without weight decay: a unit then holds two stepped tensors
        params = [
            {"params": [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]},
            {
                "params": [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias")],
                "weight_decay": 0.0,
            },
        ]
    return offload_engine(zero, model=model, params=params, mb=MB, gas=GAS)


def _parity(rank: int, world: int, tmp: str, threshold: int, frozen: bool, two_groups: bool) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(None, threshold=threshold, frozen=frozen, two_groups=two_groups)
    plain_losses = train_engine(plain, rank, world, batches, MB, GAS)
    offloaded = _engine(tmp, threshold=threshold, frozen=frozen, two_groups=two_groups)
    offloaded_losses = train_engine(offloaded, rank, world, batches, MB, GAS)
    units = offloaded.states.units
    out = {
        "plain": full_params(plain),
        "offloaded": full_params(offloaded),
        "losses": (plain_losses, offloaded_losses),
        "resident": [u.shard_resident for u in units if not u.persistent],
        "param_shard_bytes": offloaded.memory_breakdown()["param_shards"],
        "persistent_bytes": sum(u.shard_numel * 4 for u in units if u.persistent),
        "persistent": sum(1 for u in units if u.persistent),
    }
    offloaded.destroy()
    return out


@pytest.mark.parametrize(
    ("threshold", "frozen", "two_groups"), [(0, False, False), (20, True, True)], ids=["plain", "mixed-units"]
)
def test_fp32_param_and_optimizer_nvme_equal_no_offload(
    dist_run, tmp_path: Path, threshold: int, frozen: bool, two_groups: bool
) -> None:
    initial = dict(make_model().named_parameters())
    for r in dist_run(_parity, 2, str(tmp_path), threshold, frozen, two_groups):
        assert max((r["plain"][n] - initial[n]).abs().max().item() for n in initial) > 1e-3  # training moved them
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name
        if frozen:
            assert torch.equal(r["offloaded"]["inp.bias"], initial["inp.bias"])  # frozen part of a shard kept
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-6)
        assert len(r["resident"]) >= 2 and not any(r["resident"])  # no offloaded shard in memory between steps
        assert r["param_shard_bytes"] == r["persistent_bytes"]  # only persistent units hold shard memory
        assert r["persistent"] == (1 if threshold else 0)


def _resume(rank: int, world: int, tmp: str) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    first = _engine(tmp)
    train_engine(first, rank, world, batches[:3], MB, GAS)
    first.save_checkpoint(os.path.join(tmp, "ckpt"))
    saved_resident = [u.shard_resident for u in first.states.units]
    train_engine(first, rank, world, batches[3:], MB, GAS)
    out = {"continued": full_params(first), "saved_resident": saved_resident}
    first.destroy()
    resumed = _engine(tmp)
    resumed.load_checkpoint(os.path.join(tmp, "ckpt"))
    out["loaded_resident"] = [u.shard_resident for u in resumed.states.units]
    train_engine(resumed, rank, world, batches[3:], MB, GAS)
    out["resumed"] = full_params(resumed)
    resumed.destroy()
    plain = _engine(None)  # the offloaded engine's checkpoint loads without offload ...
    plain.load_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(plain, rank, world, batches[3:], MB, GAS)
    out["plain"] = full_params(plain)
    reference = _engine(None)  # ... and a checkpoint written without offload loads into an offloaded engine
    train_engine(reference, rank, world, batches[:3], MB, GAS)
    reference.save_checkpoint(os.path.join(tmp, "plain_ckpt"))
    train_engine(reference, rank, world, batches[3:], MB, GAS)
    out["reference"] = full_params(reference)
    from_plain = _engine(tmp)
    from_plain.load_checkpoint(os.path.join(tmp, "plain_ckpt"))
    train_engine(from_plain, rank, world, batches[3:], MB, GAS)
    out["from_plain"] = full_params(from_plain)
    from_plain.destroy()
    return out


def test_fp32_offloaded_checkpoint_round_trip(dist_run, tmp_path: Path) -> None:
    for r in dist_run(_resume, 2, str(tmp_path)):
        assert not any(r["saved_resident"]) and not any(r["loaded_resident"])  # one unit at a time, then evicted
        for name, p in r["continued"].items():
            assert (r["resumed"][name] - p).abs().max().item() <= 1e-6, name
            assert (r["plain"][name] - p).abs().max().item() <= 1e-6, name
            assert (r["from_plain"][name] - r["reference"][name]).abs().max().item() <= 1e-6, name


def _without_optimizer_offload(rank: int, world: int, tmp: str) -> str:
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": tmp}},
    }
    return error_of(lambda: shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config))


def test_fp32_param_nvme_without_optimizer_nvme_is_a_clear_error(dist_run, tmp_path: Path) -> None:
    for message in dist_run(_without_optimizer_offload, 2, str(tmp_path)):
        assert message.startswith("ConfigError"), message
        assert "offload_optimizer.device" in message and '"none"' in message and "bf16 or fp16" in message
