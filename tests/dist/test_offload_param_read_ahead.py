"""``offload_param`` (device "nvme", 2 ranks) reads ahead along the recorded order: the read of the unit after the
ones being gathered is issued before the current unit's forward finishes, so it overlaps that compute; the shard
buffer pool stays within ``buffer_count``; training is unchanged.

TinyNet's units (parity.py), in forward order: inp (104 elements), mid (182), mid2 (182), out (42).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from parity import full_params, global_batches, offload_engine, train_engine

STEPS, MB, GAS = 3, 2, 1
ORDER = ["inp", "mid", "mid2", "out"]


def _engine(tmp: str | None, prefetch: int, buffer_count: int) -> Any:
    zero: dict = {"stage": 3, "stage3_prefetch_bucket_size": prefetch}
    if tmp is not None:
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": os.path.join(tmp, "params"),
            "max_in_cpu": 0,
            "buffer_count": buffer_count,
        }
    return offload_engine(zero, bf16=True, mb=MB, gas=GAS)


def _read_order(rank: int, world: int, tmp: str, prefetch: int, buffer_count: int) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(None, prefetch, buffer_count)
    train_engine(plain, rank, world, batches, MB, GAS)
    engine = _engine(tmp, prefetch, buffer_count)
    offloader = engine.states.param_offloader
    names = {f"unit{u.index}": u.name for u in engine.states.units}
    events: list[tuple[str, str]] = []
    store_read = offloader.store.swap_in

    def recorded_read(key: str, out: Any) -> Any:  # every read of a shard, read ahead or not, in issue order
        events.append(("read", names[key]))
        return store_read(key, out)

    offloader.store.swap_in = recorded_read
    modules = dict(engine.module.named_modules())
    for name in ORDER:  # registered after the engine's hooks: runs once the unit's forward is over
        modules[name].register_forward_hook(lambda m, a, o, name=name: events.append(("end", name)))
    steps = []
    for batch in batches:
        events.clear()
        train_engine(engine, rank, world, [batch], MB, GAS)
        steps.append(list(events))
    pool = offloader.pool
    out = {
        "steps": steps,
        "diff": max(
            (a - b).abs().max().item() for a, b in zip(full_params(plain).values(), full_params(engine).values())
        ),
        "peak_in_use": pool.peak_in_use,
        "overflows": pool.overflows,
    }
    engine.destroy()
    return out


def _forward_events(events: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The events up to the end of the last unit's forward."""
    last = events.index(("end", ORDER[-1]))
    return events[: last + 1]


@pytest.mark.parametrize(
    "prefetch, ahead, buffer_count",
    [(0, 1, 1), (200, 2, 2)],  # no prefetch: read unit k+1 during k; prefetch one unit: read k+2 during k
    ids=["no-prefetch", "prefetch-one"],
)
def test_param_offload_reads_ahead_along_the_recorded_order(
    dist_run, tmp_path: Path, prefetch: int, ahead: int, buffer_count: int
) -> None:
    for r in dist_run(_read_order, 2, str(tmp_path), prefetch, buffer_count):
        assert r["diff"] <= 1e-6
        for events in r["steps"][1:]:  # the first step records the order
            forward = _forward_events(events)
            for k, name in enumerate(ORDER[:-ahead]):
                later = ORDER[k + ahead]
                assert forward.index(("read", later)) < forward.index(("end", name)), (later, name, forward)
            assert [e for e in forward if e[0] == "read"] == [("read", n) for n in ORDER]  # each shard read once
        assert r["overflows"] == 0 and r["peak_in_use"] <= buffer_count
