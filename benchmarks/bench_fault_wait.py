"""Cost of the interruptible wait ([Note: failure propagation] in faults/board.py) against plain collectives.

    python benchmarks/bench_fault_wait.py [--ops 200] [--repeats 7] [--numel 16]

Two forked gloo ranks run ``--ops`` tiny all-reduces (and reduce-scatters, which gloo gives no future, so a helper
thread waits for them) three ways: torch's synchronous call, ``Collectives`` without a board, ``Collectives`` with
the failure board (async + event wait). Prints µs/op per way (median of ``--repeats``) and the board's ratio to
the plain synchronous call, as JSON from rank 0. Not asserted anywhere: a loaded machine moves the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import run_ranks
from shardspeed.comm import Collectives
from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.faults.process import failure_board
from shardspeed.topology import AxisGroup


def _bench(rank: int, world: int, ops: int, repeats: int, numel: int) -> dict:
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    plain = Collectives()
    boarded = Collectives(board=failure_board(FaultToleranceConfig()))
    tensor, shard = torch.ones(numel * world), torch.empty(numel)

    def sync_all_reduce() -> None:
        dist.all_reduce(tensor)

    def sync_reduce_scatter() -> None:
        dist.reduce_scatter_tensor(shard, tensor)

    ways = {
        "all_reduce/torch sync": sync_all_reduce,
        "all_reduce/Collectives, no board": lambda: plain.all_reduce(tensor, axis),
        "all_reduce/Collectives + board": lambda: boarded.all_reduce(tensor, axis),
        "reduce_scatter/torch sync": sync_reduce_scatter,
        "reduce_scatter/Collectives, no board": lambda: plain.reduce_scatter(shard, tensor, axis),
        "reduce_scatter/Collectives + board": lambda: boarded.reduce_scatter(shard, tensor, axis),
    }
    timings: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, call in ways.items():  # interleaved, so load changes hit every way alike
            dist.barrier()
            start = time.perf_counter()
            for _ in range(ops):
                call()
            timings[name].append((time.perf_counter() - start) / ops * 1e6)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    ratios = {
        op: medians[f"{op}/Collectives + board"] / medians[f"{op}/torch sync"]
        for op in ("all_reduce", "reduce_scatter")
    }
    return {"us_per_op_median": medians, "board_vs_sync_ratio": ratios, "ops": ops, "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--numel", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_bench, 2, Path(tmp), args.ops, args.repeats, args.numel, deadline_s=600)
    print(json.dumps(results[0], indent=2))


if __name__ == "__main__":
    main()
