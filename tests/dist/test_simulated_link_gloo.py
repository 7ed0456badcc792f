"""[Note: simulated link] over real gloo: async calls return at once and complete at the simulated deadline;
synchronous calls (and the compressed collectives) take at least the simulated time."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from harness import run_ranks
from shardspeed.comm import Collectives, CommsLog
from shardspeed.comm.simulated_link import SimulatedLink
from shardspeed.compression import CompressedAllReduce
from shardspeed.topology import AxisGroup

NUMEL = 1 << 18  # 1 MiB of fp32: an all-reduce at world 2 moves 1 MiB per rank = 8.4 Mbit


def _timings(rank: int, world: int) -> dict[str, Any]:
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    link = SimulatedLink(0.05, 1000.0)  # 50 Mbit/s, 1 ms: ~0.17 s for the all-reduce
    c = Collectives(CommsLog(enabled=True), link=link)
    x = torch.ones(NUMEL)
    start = time.perf_counter()
    work = c.all_reduce(x, axis, async_op=True)
    launched = time.perf_counter() - start
    not_done = not work.done()
    work.wait()
    async_s = time.perf_counter() - start
    start = time.perf_counter()
    c.all_reduce(x, axis)
    sync_s = time.perf_counter() - start
    start = time.perf_counter()
    CompressedAllReduce(NUMEL, axis, c, device=torch.device("cpu"))(x)
    compressed_s = time.perf_counter() - start
    plain = Collectives(CommsLog())
    start = time.perf_counter()
    plain.all_reduce(x, axis)
    plain_s = time.perf_counter() - start
    expected = link.transfer_s(2 * (world - 1) / world * 4 * NUMEL)
    return {
        "launched": launched,
        "not_done": not_done,
        "async": async_s,
        "sync": sync_s,
        "compressed": compressed_s,
        "plain": plain_s,
        "expected": expected,
        "sum": x[0].item(),
    }


def test_simulated_link_delays_completion_not_launch(tmp_path: Any) -> None:
    for r in run_ranks(_timings, 2, tmp_path):
        assert r["launched"] < 0.5 * r["expected"] and r["not_done"]
        assert r["expected"] <= r["async"] < r["expected"] + 1.0
        assert r["expected"] <= r["sync"] < r["expected"] + 1.0
        # four calls, ~1/32 of the bytes: far below one fp32 all-reduce, but at least four latencies
        assert 4e-3 <= r["compressed"] < 0.5 * r["expected"]
        assert r["plain"] < r["expected"]  # off by default
