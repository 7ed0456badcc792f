"""ZeRO-3 parameter offload (``offload_param``) equals stage 3 without it; offloaded shards are not in memory
between uses; the swap file is per rank, never visible under nvme_path and closed on destroy; checkpoints
round-trip; unsupported combinations are clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from parity import full_params, global_batches, make_model, offload_engine, train_engine

import shardspeed
from harness import deleted_files_held, error_of

STEPS, MB, GAS = 5, 2, 2


def _engine(param: dict | None, *, bf16: bool = True, optimizer_offload: dict | None = None, threshold: int = 0):
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": threshold}
    if param is not None:
        zero["offload_param"] = param
    if optimizer_offload is not None:
        zero["offload_optimizer"] = optimizer_offload
    return offload_engine(zero, bf16=bf16, mb=MB, gas=GAS)


def _nvme(tmp: str) -> dict:
    return {"device": "nvme", "nvme_path": os.path.join(tmp, "swap"), "max_in_cpu": 0}  # every shard to NVMe


def _parity(rank: int, world: int, tmp: str, device: str, bf16: bool, with_optimizer_offload: bool) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(None, bf16=bf16)
    train_engine(plain, rank, world, batches, MB, GAS)
    param = _nvme(tmp) if device == "nvme" else {"device": device}
    optimizer_offload = {"device": "nvme", "nvme_path": os.path.join(tmp, "opt")} if with_optimizer_offload else None
    offloaded = _engine(param, bf16=bf16, optimizer_offload=optimizer_offload)
    train_engine(offloaded, rank, world, batches, MB, GAS)
    units = offloaded.states.units
    result = {
        "plain": full_params(plain),
        "offloaded": full_params(offloaded),
        "named": sorted(os.listdir(os.path.join(tmp, "swap"))) if device == "nvme" else [],
        "held": sorted(deleted_files_held(os.path.join(tmp, "swap")).values()) if device == "nvme" else [],
        "param_shard_bytes": (plain.memory_breakdown()["param_shards"], offloaded.memory_breakdown()["param_shards"]),
        "shard_numel_bytes": sum(u.shard_numel * 2 for u in units if not u.persistent),  # bf16 shards
        "persistent_bytes": sum(u.shard_numel * u.shard.element_size() for u in units if u.persistent),
        "resident": [u.shard_resident for u in units if not u.persistent],
        "unit_count": sum(1 for u in units if not u.persistent),
    }
    offloaded.destroy()
    result["held_after_destroy"] = (
        sorted(deleted_files_held(os.path.join(tmp, "swap")).values()) if device == "nvme" else []
    )
    return result


def _check_parity(results: list[dict]) -> None:
    initial = dict(make_model().named_parameters())
    for r in results:
        moved = max((r["plain"][n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3  # training really changed the parameters
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name


@pytest.mark.parametrize("with_optimizer_offload", [False, True])
def test_nvme_param_offload_equals_no_offload_bf16(dist_run, tmp_path: Path, with_optimizer_offload: bool) -> None:
    results = dist_run(_parity, 2, str(tmp_path), "nvme", True, with_optimizer_offload)
    _check_parity(results)
    for rank, r in enumerate(results):
        assert r["unit_count"] >= 2  # several units really went through the swap file
        assert r["resident"] == [False] * r["unit_count"]  # between steps no offloaded shard is in memory
        plain_bytes, offloaded_bytes = r["param_shard_bytes"]
        assert plain_bytes == r["shard_numel_bytes"] + r["persistent_bytes"] > 0
        assert offloaded_bytes == r["persistent_bytes"]  # only the persistent (small) parameters stay
        assert r["named"] == []  # nothing under nvme_path by name, even while training
        assert len(r["held"]) == 1 and r["held"][0].endswith(f"-rank{rank}/swap.bin (deleted)")  # this rank's
        assert r["held_after_destroy"] == []  # destroy closed it: its space is free


def test_cpu_param_offload_without_accelerator_is_a_no_op_fp32(dist_run, tmp_path: Path) -> None:
    results = dist_run(_parity, 2, str(tmp_path), "cpu", False, False)
    _check_parity(results)
    for r in results:
        assert r["param_shard_bytes"][0] == r["param_shard_bytes"][1]  # shards already in host memory


def test_persistent_params_stay_in_memory(dist_run, tmp_path: Path) -> None:
    """With a threshold above the small biases, a persistent unit exists and is never offloaded."""

    def run(rank: int, world: int, tmp: str) -> tuple[int, int, list[bool]]:
        engine = _engine(_nvme(tmp), threshold=20)
        train_engine(engine, rank, world, global_batches(1, MB * GAS * world), MB, GAS)
        persistent = [u for u in engine.states.units if u.persistent]
        out = (len(persistent), engine.memory_breakdown()["param_shards"], [u.shard_resident for u in persistent])
        engine.destroy()
        return out

    for count, shard_bytes, resident in dist_run(run, 2, str(tmp_path)):
        assert count == 1 and resident == [True] and shard_bytes > 0


def _fp32_nvme(rank: int, world: int, tmp: str) -> str:
    return error_of(lambda: _engine(_nvme(tmp), bf16=False))


def test_nvme_param_offload_in_fp32_is_a_clear_error(dist_run, tmp_path: Path) -> None:
    for message in dist_run(_fp32_nvme, 2, str(tmp_path)):
        assert message.startswith("ConfigError"), message
        assert "offload_param.device" in message and "bf16 or fp16" in message


def _resume(rank: int, world: int, tmp: str) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    first = _engine(_nvme(tmp))
    train_engine(first, rank, world, batches[:3], MB, GAS)
    first.save_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(first, rank, world, batches[3:], MB, GAS)
    continued = full_params(first)
    first.destroy()
    resumed = _engine(_nvme(tmp))
    resumed.load_checkpoint(os.path.join(tmp, "ckpt"))
    loaded_resident = [u.shard_resident for u in resumed.states.units if not u.persistent]
    train_engine(resumed, rank, world, batches[3:], MB, GAS)
    out = {"continued": continued, "resumed": full_params(resumed), "loaded_resident": loaded_resident}
    resumed.destroy()
    plain = _engine(None)  # the same checkpoint loads into an engine without offload
    plain.load_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(plain, rank, world, batches[3:], MB, GAS)
    out["plain"] = full_params(plain)
    return out


def test_nvme_param_offload_checkpoint_round_trip(dist_run, tmp_path: Path) -> None:
    for r in dist_run(_resume, 2, str(tmp_path)):
        assert not any(r["loaded_resident"])  # the load wrote the shards back to the swap file
        for name, p in r["continued"].items():
            assert (r["resumed"][name] - p).abs().max().item() <= 1e-6, name
            assert (r["plain"][name] - p).abs().max().item() <= 1e-6, name


def _edit(rank: int, world: int, tmp: str) -> torch.Tensor:
    engine = _engine(_nvme(tmp))
    with shardspeed.zero.GatheredParameters([engine.module.mid.weight], modifier_rank=0):
        if rank == 0:
            engine.module.mid.weight.data.fill_(0.25)
    with torch.no_grad():  # gathers and frees every unit: the edited shard goes to the swap file here
        engine(torch.zeros(MB, 7, dtype=torch.bfloat16))
    resident = engine.states.units[engine.states.units.index(_unit_of(engine, "mid.weight"))].shard_resident
    weight = engine.module_state_dict()["mid.weight"].float()  # read back from the swap file
    assert not resident
    engine.destroy()
    return weight


def _unit_of(engine, name: str):
    return next(u for u in engine.states.units if name in u.names)


def test_gathered_parameters_edit_survives_offload(dist_run, tmp_path: Path) -> None:
    """An edit published by GatheredParameters is written to the swap file when the shard is next freed."""
    for weight in dist_run(_edit, 2, str(tmp_path)):
        assert torch.equal(weight, torch.full_like(weight, 0.25))


def _host_store_parity(rank: int, world: int, tmp: str) -> dict:
    """The host-memory store ``device: "cpu"`` uses with an accelerator, attached by hand on this CPU machine."""
    from shardspeed.offload.aio_config import AioSettings
    from shardspeed.zero.stage3.param_offload import build_param_offloader

    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(None)
    train_engine(plain, rank, world, batches, MB, GAS)
    hosted = _engine(None)
    units = [u for u in hosted.states.units if not u.persistent]
    offloader = build_param_offloader(
        units, "cpu", nvme_path=None, pin_memory=True, settings=AioSettings(), rank=rank, agree=lambda o: [o]
    )
    hosted.states.offload_params(offloader)
    train_engine(hosted, rank, world, batches, MB, GAS)
    out = {"plain": full_params(plain), "offloaded": full_params(hosted), "resident": [u.shard_resident for u in units]}
    hosted.destroy()
    return out


def test_host_store_param_offload_equals_no_offload(dist_run, tmp_path: Path) -> None:
    results = dist_run(_host_store_parity, 2, str(tmp_path))
    _check_parity(results)
    for r in results:
        assert r["resident"] and not any(r["resident"])
