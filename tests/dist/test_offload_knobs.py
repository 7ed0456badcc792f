"""``offload_optimizer``'s ``ratio``, ``fast_init`` and ``buffer_count`` in real 2-rank ZeRO runs: each setting
trains exactly as the same stage without offload, holds what it says in memory, and checkpoints round-trip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parity import full_params, global_batches, train_engine
from test_offload import GAS, MB, STEPS, _engine

KNOBS = {
    "ratio": {"ratio": 0.5},
    "fast_init": {"fast_init": True},
    "sequential": {"buffer_count": 4, "pipeline_read": False, "pipeline_write": False},
    "all": {"ratio": 0.3, "fast_init": True, "buffer_count": 15},
}


def _knob_run(rank: int, world: int, stage: int, knob: str, tmp: str) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(stage, None)
    train_engine(plain, rank, world, batches[:3], MB, GAS)
    offload = {"device": "nvme", "nvme_path": os.path.join(tmp, "swap"), **KNOBS[knob]}
    tuned = _engine(stage, offload)
    train_engine(tuned, rank, world, batches[:3], MB, GAS)
    tuned.save_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(plain, rank, world, batches[3:], MB, GAS)
    train_engine(tuned, rank, world, batches[3:], MB, GAS)
    resumed = _engine(stage, offload)
    resumed.load_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(resumed, rank, world, batches[3:], MB, GAS)
    optimizer = tuned.optimizer
    stepped = sum(t.numel() for g in optimizer.param_groups for t in g["params"])
    kept = sum(c.end - c.start for chunks in optimizer.group_chunks for c in chunks if not c.offloaded)
    out = {
        "plain": full_params(plain),
        "tuned": full_params(tuned),
        "resumed": full_params(resumed),
        "stepped": stepped,
        "kept": kept,
        "state_bytes": tuned.memory_breakdown()["optimizer_states"],
    }
    for engine in (plain, tuned, resumed):
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_offload_knobs_equal_no_offload(dist_run, tmp_path: Path, stage: int, knob: str) -> None:
    ratio = KNOBS[knob].get("ratio", 1.0)
    for r in dist_run(_knob_run, 2, stage, knob, str(tmp_path)):
        for name, p in r["plain"].items():
            assert (r["tuned"][name] - p).abs().max().item() <= 1e-6, name
            assert (r["resumed"][name] - p).abs().max().item() <= 1e-6, name
        # ratio keeps whole sub-groups (37 elements here) in memory: the rest of ratio × the stepped elements
        assert r["stepped"] * (1 - ratio) - 37 < r["kept"] <= r["stepped"] * (1 - ratio) + 1e-9
        assert r["state_bytes"] == 8 * r["kept"]  # two fp32 moments per kept element, none for the offloaded
