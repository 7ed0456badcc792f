"""Compressed collectives against their fp32 peers: bytes per rank and time, on real gloo and on a SIMULATED link.

    python benchmarks/bench_compressed_collective.py [--worlds 2,4] [--log2-sizes 20,22,24] [--repeats 5]
                                                     [--links real,10,1] [--latency-us 50] [--json OUT]

For each world size (forked gloo ranks on this host), flat fp32 bucket size and link, every repeat times four
calls back to back on the same input: an fp32 all-reduce (``Collectives.all_reduce``, then / N for the mean),
``CompressedAllReduce``, an fp32 reduce-scatter and ``CompressedReduceScatter`` (synchronous; a barrier before
each; rank 0's wall time). Printed per row: the algorithmic bytes per rank the comms log counted, compressed /
fp32 (scales and padding included), and the per-repeat time ratio compressed / fp32 as median [IQR]
(``stats.py``). ``real`` is the host's gloo (shared memory: compute-bound, so compression does not pay);
``10`` / ``1`` are SIMULATED links of 10 and 1 Gbit/s ([Note: simulated link] in comm/simulated_link.py: each
call completes at its start on the rank's one link + bytes / bandwidth + latency, calls in flight sharing the
link), rows labelled ``SIMULATED``. Nothing is asserted: timings
on a shared machine are not test material; tests/dist/test_compressed_collectives.py checks the byte ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from stats import summarize_ratios

from shardspeed.comm import Collectives, CommsLog
from shardspeed.comm.simulated_link import SimulatedLink
from shardspeed.compression import CompressedAllReduce, CompressedReduceScatter
from shardspeed.topology import AxisGroup

OPS = ("all_reduce", "reduce_scatter")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--log2-sizes", default="20,22,24", help="log2 of the bucket's elements (default 20,22,24)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per row (default 5)")
    parser.add_argument("--links", default="real,10,1", help="'real' and/or simulated Gbit/s (default real,10,1)")
    parser.add_argument("--latency-us", type=float, default=50.0, help="simulated latency per call (default 50)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    args.world_list = [int(w) for w in args.worlds.split(",")]
    args.size_list = [1 << int(s) for s in args.log2_sizes.split(",")]
    args.link_list = [None if s.strip() == "real" else float(s) for s in args.links.split(",")]
    if args.repeats < 1 or any(w < 2 for w in args.world_list):
        parser.error("--repeats must be >= 1 and every world size >= 2")
    return args


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _repeat(
    c: Collectives,
    ar: CompressedAllReduce,
    rs: CompressedReduceScatter,
    x: torch.Tensor,
    shard: torch.Tensor,
    axis: AxisGroup,
) -> dict[str, float]:
    """One timed call of each: fp32 all-reduce (mean), compressed all-reduce, fp32 reduce-scatter (mean),
    compressed reduce-scatter."""
    y, n = x.clone(), axis.size
    return {
        "ar32": _timed(lambda: (c.all_reduce(y, axis, tag="fp32_ar"), y.div_(n))),
        "ar1": _timed(lambda: ar(x.clone())),
        "rs32": _timed(lambda: (c.reduce_scatter(shard, x, axis, tag="fp32_rs"), shard.div_(n))),
        "rs1": _timed(lambda: rs(shard, x)),
    }


HEAD = (
    f"{'link':<22}{'world':>6}{'elements':>11}  {'op':<15}{'bytes ratio':>13}{'x 32':>8}"
    f"{'fp32 s':>9}{'1-bit s':>9}{'time ratio':>12}  IQR"
)


def format_row(r: dict[str, Any]) -> str:
    q25, q75 = r["time_ratio_iqr"]
    return (
        f"{r['link']:<22}{r['world']:>6}{r['numel']:>11}  {r['op']:<15}{r['bytes_ratio']:>13.6f}"
        f"{r['bytes_ratio'] * 32:>8.4f}{r['fp32_s_median']:>9.3f}{r['compressed_s_median']:>9.3f}"
        f"{r['time_ratio_median']:>12.3f}  [{q25:.3f}, {q75:.3f}]"
    )


def _rank_rows(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    cpu, rows = torch.device("cpu"), []
    for gbps in args.link_list:
        link = None if gbps is None else SimulatedLink(gbps, args.latency_us)
        for numel in args.size_list:
            c = Collectives(CommsLog(enabled=True), link=link)
            ar = CompressedAllReduce(numel, axis, c, device=cpu, tag="1bit_ar")
            rs = CompressedReduceScatter(numel, axis, c, device=cpu, tag="1bit_rs")
            x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            shard = torch.empty(numel // world)
            times: dict[str, list[float]] = {k: [] for k in ("ar32", "ar1", "rs32", "rs1")}
            for repeat in range(args.repeats + 1):  # the first is a warm-up, not kept
                t = _repeat(c, ar, rs, x, shard, axis)
                if repeat == 0:
                    c.log.reset()
                    continue
                for k, v in t.items():
                    times[k].append(v)
            log = c.log
            bytes_ratio = {
                "all_reduce": log.algorithmic_bytes(tag="1bit_ar") / log.algorithmic_bytes(tag="fp32_ar"),
                "reduce_scatter": log.algorithmic_bytes(tag="1bit_rs") / log.algorithmic_bytes(tag="fp32_rs"),
            }
            for op, fp32, one in (("all_reduce", "ar32", "ar1"), ("reduce_scatter", "rs32", "rs1")):
                s = summarize_ratios(times[one], times[fp32])
                rows.append(
                    {
                        "world": world,
                        "numel": numel,
                        "link": "real gloo" if gbps is None else f"SIMULATED {gbps:g} Gbit/s",
                        "op": op,
                        "bytes_ratio": bytes_ratio[op],
                        "time_ratio_median": s.median,
                        "time_ratio_iqr": (s.q25, s.q75),
                        "fp32_s_median": sorted(times[fp32])[len(times[fp32]) // 2],
                        "compressed_s_median": sorted(times[one])[len(times[one]) // 2],
                    }
                )
                if rank == 0:
                    print(format_row(rows[-1]), flush=True)
    return rows


def _child(rank: int, world: int, store_path: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
        rows = _rank_rows(rank, world, args)
        if rank == 0:
            queue.put(("ok", rows))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        queue.put(("err", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        os._exit(0)


def run_world(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fork ``world`` gloo ranks on this host; rank 0's rows."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_child, args=(r, world, os.path.join(tmp, "store"), args, queue)) for r in range(world)
        ]
        for p in procs:
            p.start()
        status, value = queue.get()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # forked ranks hang on a parent's OpenMP pool otherwise
    print(
        f"compressed (1-bit, error-fed) / fp32, {args.repeats} repeats; time ratio median [IQR]; SIMULATED rows "
        f"add latency {args.latency_us:g} us + bytes/bandwidth per call (comm/simulated_link.py)"
    )
    print(HEAD, flush=True)
    rows = [row for world in args.world_list for row in run_world(world, args)]  # rank 0 prints each row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
