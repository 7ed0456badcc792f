"""``offload_param``'s ``max_in_cpu``, ``buffer_count`` and ``buffer_size`` (device "nvme", 2 ranks): training
equals stage 3 without offload whatever they are; ``max_in_cpu`` keeps the leading units in host memory and the
swap file holds exactly the others; the shard buffer pool stays within ``buffer_count`` × ``buffer_size``; a
``buffer_size`` below a unit's shard is the same ``ConfigError`` on every rank.

TinyNet's units (parity.py) and their per-rank shards at world size 2: inp 52, mid 91, mid2 91, out 21 elements.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from parity import OFFLOAD_AIO, full_params, global_batches, make_model, offload_engine, train_engine

import shardspeed
from harness import deleted_files_held, error_of

STEPS, MB, GAS = 4, 2, 2
BLOCK = OFFLOAD_AIO["block_size"]  # the swapper gives each tensor whole blocks


def _engine(tmp: str | None, *, bf16: bool = True, prefetch: int | None = None, **param_knobs: int):
    zero: dict = {"stage": 3}
    if prefetch is not None:
        zero["stage3_prefetch_bucket_size"] = prefetch
    if tmp is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "params"), **param_knobs}
        if not bf16:  # fp32 shards leave memory only with the streamed optimizer
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "opt")}
    return offload_engine(zero, bf16=bf16, mb=MB, gas=GAS)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


# --- (a) max_in_cpu splits the units -------------------------------------------------------------------------
def _split(rank: int, world: int, tmp: str, bf16: bool) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(None, bf16=bf16)
    train_engine(plain, rank, world, batches, MB, GAS)
    engine = _engine(tmp, bf16=bf16, max_in_cpu=52 + 91)  # inp and mid fit exactly; mid2 does not
    train_engine(engine, rank, world, batches, MB, GAS)
    offloader = engine.states.param_offloader
    units = engine.states.units
    out = {
        "moved": _max_diff(full_params(plain), {n: p.detach().float() for n, p in make_model().named_parameters()}),
        "diff": _max_diff(full_params(plain), full_params(engine)),
        "units": [(u.name, u.shard_numel, u.shard.element_size() if u.shard.numel() else None) for u in units],
        "resident": {u.name: u.shard_resident for u in units},
        "has_offloader": {u.name: u.offloader is not None for u in units},
        "swap_names": offloader.store.names,
        "swap_file_bytes": offloader.swap_file_bytes,
        "offloaded_bytes": offloader.offloaded_bytes,
        "in_cpu_bytes": offloader.in_cpu_bytes,
        "param_shard_bytes": engine.memory_breakdown()["param_shards"],
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32-optimizer-nvme"])
def test_max_in_cpu_keeps_leading_units_in_memory(dist_run, tmp_path: Path, bf16: bool) -> None:
    itemsize = 2 if bf16 else 4
    shard = {"inp": 52, "mid": 91, "mid2": 91, "out": 21}
    for r in dist_run(_split, 2, str(tmp_path), bf16):
        assert [(name, numel) for name, numel, _ in r["units"]] == list(shard.items())  # the layout assumed here
        assert r["moved"] > 1e-3 and r["diff"] <= 1e-6
        assert r["resident"] == {"inp": True, "mid": True, "mid2": False, "out": False}
        assert r["has_offloader"] == {"inp": False, "mid": False, "mid2": True, "out": True}
        assert r["swap_names"] == ["unit2", "unit3"]  # only mid2 and out ever reached the swap file
        assert r["swap_file_bytes"] == _round_up(91 * itemsize) + _round_up(21 * itemsize)
        assert r["offloaded_bytes"] == (91 + 21) * itemsize
        assert r["in_cpu_bytes"] == r["param_shard_bytes"] == (52 + 91) * itemsize


# --- (b) the buffer pool is bounded --------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _pool(rank: int, world: int, tmp: str) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(None)
    train_engine(plain, rank, world, batches, MB, GAS)
    reference = full_params(plain)
    records = _Records()
    logging.getLogger("shardspeed").addHandler(records)
    out = {}
    # (buffer_count, prefetch bucket): one buffer with prefetch of the whole model ahead overflows; without
    # prefetch one suffices; three cover the three units prefetched ahead of the first
    for count, prefetch in [(1, None), (1, 0), (3, None)]:
        records.messages.clear()
        engine = _engine(tmp, prefetch=prefetch, max_in_cpu=0, buffer_size=91, buffer_count=count)
        train_engine(engine, rank, world, batches, MB, GAS)
        offloader = engine.states.param_offloader
        out[(count, prefetch)] = {
            "diff": _max_diff(reference, full_params(engine)),
            "pool_bytes": offloader.pool_bytes,
            "overflows": offloader.pool_overflows,
            "peak_in_use": offloader.pool.peak_in_use,
            "warnings": [m for m in records.messages if "buffer_count" in m],
            "resident": [u.shard_resident for u in engine.states.units],
        }
        engine.destroy()
    logging.getLogger("shardspeed").removeHandler(records)
    return out


def test_buffer_pool_stays_within_count_times_size(dist_run, tmp_path: Path) -> None:
    for r in dist_run(_pool, 2, str(tmp_path)):
        for (count, _), run in r.items():
            assert run["diff"] <= 1e-6
            assert 0 < run["pool_bytes"] <= count * 91 * 2  # buffer_count × buffer_size × bf16
            assert run["peak_in_use"] <= count and not any(run["resident"])
        deep = r[(1, None)]
        assert deep["overflows"] > 0 and len(deep["warnings"]) == 1  # counted every time, warned once
        assert "buffer_count = 1" in deep["warnings"][0] and "at least 3" in deep["warnings"][0]
        assert r[(1, 0)]["overflows"] == 0 and r[(1, 0)]["warnings"] == []
        assert r[(3, None)]["overflows"] == 0 and r[(3, None)]["peak_in_use"] == 3


# --- (c) buffer_size below a shard ---------------------------------------------------------------------------
def _too_small(rank: int, world: int, tmp: str) -> tuple[str, int]:
    message = error_of(lambda: _engine(tmp, max_in_cpu=52, buffer_size=90))
    return message, len(deleted_files_held(tmp))  # no swap file left open


def test_buffer_size_below_a_shard_fails_every_rank(dist_run, tmp_path: Path) -> None:
    results = dist_run(_too_small, 2, str(tmp_path))
    assert [held for _, held in results] == [0, 0]
    messages = [message for message, _ in results]
    assert messages[0] == messages[1]
    message = messages[0]
    assert message.startswith("ConfigError: zero_optimization.offload_param.buffer_size = 90"), message
    assert "'mid'" in message and "'mid.weight'" in message and "at least 91" in message, message


def _edit_everything(rank: int, world: int, tmp: str, bf16: bool) -> dict:
    engine = _engine(tmp, bf16=bf16, max_in_cpu=0, buffer_count=2)
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        if rank == 0:
            for p in engine.module.parameters():
                p.data.fill_(0.125)
    offloaded = [u for u in engine.states.units if u.offloader is not None]
    out = {
        "resident": [u.name for u in offloaded if u.shard_resident],
        "pool_in_use": engine.states.param_offloader.pool.in_use,
        "offloaded": len(offloaded),
        "values": engine.module_state_dict(),  # read back from the swap file
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32-optimizer-nvme"])
def test_gathered_parameters_edits_go_back_to_the_store(dist_run, tmp_path: Path, bf16: bool) -> None:
    """Editing every parameter under GatheredParameters leaves no shard in host memory after the block (the pool
    bound holds) and the edit is what the swap file returns."""
    for r in dist_run(_edit_everything, 2, str(tmp_path), bf16):
        assert r["offloaded"] >= 2 and r["resident"] == [] and r["pool_in_use"] == 0, r
        for name, value in r["values"].items():
            assert torch.equal(value.float(), torch.full_like(value.float(), 0.125)), name
