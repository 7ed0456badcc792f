"""[Note: simulated link] over real gloo: async calls return at once and complete at the simulated deadline;
synchronous calls take at least the simulated time, the compressed all-reduce at least two latencies (both phases)."""

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
LATENCY_S = 0.25  # the compressed check's latency: far above its compute (~10 ms) and its bytes' time


def _timings(rank: int, world: int) -> dict[str, Any]:
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    link = SimulatedLink(0.05, 1000.0, sleep=sleep)  # 50 Mbit/s, 1 ms: ~0.17 s for the all-reduce
    c = Collectives(CommsLog(enabled=True), link=link)
    x = torch.ones(NUMEL)
    start = time.perf_counter()
    work = c.all_reduce(x, axis, async_op=True)
    launched, slept_at_launch = time.perf_counter() - start, len(slept)
    not_done = not work.done()
    work.wait()
    async_s = time.perf_counter() - start
    start = time.perf_counter()
    c.all_reduce(x, axis)
    sync_s = time.perf_counter() - start
    # latency-dominated link (1 Gbit/s: bytes negligible): each of the compressed path's two dependent phases
    # must wait one LATENCY, so it takes >= 2 latencies only if phase two (issued in wait()) honours the link too
    slow = Collectives(CommsLog(enabled=True), link=SimulatedLink(1.0, LATENCY_S * 1e6))
    start = time.perf_counter()
    CompressedAllReduce(NUMEL, axis, slow, device=torch.device("cpu"))(x)
    compressed_s = time.perf_counter() - start
    compressed_bytes_s = slow.log.algorithmic_bytes(tag="compressed") * 8 / 1e9
    plain = Collectives(CommsLog())
    start = time.perf_counter()
    plain.all_reduce(x, axis)
    plain_s = time.perf_counter() - start
    expected = link.transfer_s(2 * (world - 1) / world * 4 * NUMEL)
    return {
        "slept_at_launch": slept_at_launch,
        "launched": launched,
        "not_done": not_done,
        "async": async_s,
        "sync": sync_s,
        "compressed": compressed_s,
        "compressed_floor": 2 * LATENCY_S + compressed_bytes_s,
        "plain": plain_s,
        "expected": expected,
        "sum": x[0].item(),
    }


def test_simulated_link_delays_completion_not_launch(tmp_path: Any) -> None:
    for r in run_ranks(_timings, 2, tmp_path):
        assert r["slept_at_launch"] == 0  # the caller is never slept at launch
        assert r["not_done"] or r["launched"] >= r["expected"]  # (a very loaded host may launch that slowly)
        assert r["expected"] <= r["async"] < r["expected"] + 1.0
        assert r["expected"] <= r["sync"] < r["expected"] + 1.0
        # two dependent phases, each at least one simulated latency (review A #4): with phase two ignoring the
        # link this would be ~1 latency + compute, under the floor
        assert r["compressed_floor"] <= r["compressed"] < r["compressed_floor"] + 1.0
        assert r["plain"] < r["expected"]  # off by default
