"""Activation checkpointing: step-time cost of the recompute, and the activation-memory table.

    python benchmarks/bench_checkpointing.py [--blocks 8] [--tokens 1024] [--hidden 256] [--rounds 7]
                                             [--steps 5] [--threads 1] [--no-partition]

Model: ``--blocks`` blocks of Linear(H, 4H) → GELU → Dropout(0.1) → Linear(4H, H) on ``--tokens`` × H inputs, fp32,
on the CPU (or the current CUDA device when there is one — memory is then still counted by the same tracker).

Timing: each round times ``--steps`` forward+backward steps of every row back to back, in an order that
reverses from round to round so drift does not favour the row that runs first; the per-round ratio row/plain
is summarised by its median and IQR (``stats.py``). The expected cost of checkpointing every block is one extra
forward per step, i.e. about 4/3 of the plain step (backward ≈ 2 forwards), a little less where the backward is
relatively more expensive.

Memory: torch's allocation tracker (``MemTracker``) counts live tensor bytes at every op; the table gives the
peak during forward + backward and what is alive after the forward, above the entry state (parameters, input and
gradients, which a warm-up pass allocates). The bound is the issue's: checkpointing every block keeps L inputs
and one block's activations, so its peak should be at most (L·b_in + b_block)/(L·b_block) of the plain run's,
+5% of the plain run's. The partitioned row runs on two forked gloo ranks forming a 2-rank tensor axis.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from stats import summarize_ratios
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shardspeed import checkpointing
from shardspeed.checkpointing import CheckpointingContext
from shardspeed.config.activation import ActivationCheckpointingConfig
from shardspeed.topology import MeshShape, Topology

Forward = Callable[[nn.ModuleList, torch.Tensor], torch.Tensor]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8, help="L, the number of blocks (default 8)")
    parser.add_argument("--tokens", type=int, default=1024, help="rows of the input (default 1024)")
    parser.add_argument("--hidden", type=int, default=256, help="H, the block width (default 256)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--steps", type=int, default=5, help="steps per row per round (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--no-partition", action="store_true", help="skip the 2-rank partitioned memory row")
    return parser.parse_args(argv)


def make_blocks(blocks: int, hidden: int, device: torch.device) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * hidden, hidden))
        for _ in range(blocks)
    ]
    return nn.ModuleList(layers).to(device)


def plain(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def checkpointed(every: int = 1, **options: bool) -> Forward:
    ctx = CheckpointingContext(ActivationCheckpointingConfig(**options))
    return lambda blocks, x: checkpointing.run_blocks(blocks, x, every=every, context=ctx)


ROWS: dict[str, Forward] = {
    "plain": plain,
    "checkpoint every block": checkpointed(),
    "checkpoint every 2nd block": checkpointed(every=2),
    "every block, cpu_checkpointing": checkpointed(cpu_checkpointing=True),
}


def step(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor) -> None:
    forward(blocks, x).square().mean().backward()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_rows(blocks: nn.ModuleList, x: torch.Tensor, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of every row, one entry per round (rows alternate order round by round)."""
    names = list(ROWS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: allocator, thread pools, autograd caches
        step(ROWS[name], blocks, x)
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                step(ROWS[name], blocks, x)
            synchronize()
            times[name].append((time.perf_counter() - started) / steps)
    return times


def tracked_total(tracker: MemTracker, device: torch.device, kind: str = "current") -> int:
    return tracker.get_tracker_snapshot(kind).get(device, {}).get("Total", 0)


def measure(tracker: MemTracker, forward: Forward, blocks: nn.ModuleList, x: torch.Tensor) -> dict[str, int]:
    """Peak bytes during forward + backward and bytes alive after the forward, above the entry state."""
    step(forward, blocks, x)  # allocates the gradients before tracking
    blocks.zero_grad(set_to_none=False)
    tracker.track_external(blocks)
    with tracker:
        base = tracked_total(tracker, x.device)
        out = forward(blocks, x * 1.0)  # block 0's input belongs to the step, like every other block's
        after_forward = tracked_total(tracker, x.device) - base
        out.square().mean().backward()
        del out
    tracker.reset_mod_stats()
    return {"peak": tracked_total(tracker, x.device, "peak") - base, "after_forward": after_forward}


def block_bytes(blocks: nn.ModuleList, x: torch.Tensor) -> int:
    """b_block: what one plain block's forward adds to the tracked memory (saved activations and output)."""
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    with tracker:
        base = tracked_total(tracker, x.device)
        out = blocks[0](x)
        added = tracked_total(tracker, x.device) - base
    del out
    return added


def _partition_rank(rank: int, store_path: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        topology = Topology.build(MeshShape(tensor=2))
        blocks = make_blocks(args.blocks, args.hidden, torch.device("cpu"))
        x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
        rows = {}
        for name, partition in (("checkpoint every block", False), ("every block, partitioned over 2", True)):
            ctx = CheckpointingContext(
                ActivationCheckpointingConfig(partition_activations=partition), tensor_axis=topology.tensor
            )
            tracker = MemTracker()
            tracker.track_external(blocks, x)
            torch.manual_seed(3)  # same dropout on both ranks: block inputs stay replicated
            rows[name] = measure(tracker, lambda b, h, ctx=ctx: checkpointing.run_blocks(b, h, context=ctx), blocks, x)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def partitioned_rows(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """The same model on two forked ranks forming a tensor axis of 2, with and without partitioning."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_partition_rank, args=(r, store, args, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        rows = queue.get(timeout=300)
        for proc in procs:
            proc.join(timeout=60)
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:9.2f}"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    blocks = make_blocks(args.blocks, args.hidden, device)
    x = torch.randn(args.tokens, args.hidden, device=device)
    L, b_in = args.blocks, x.numel() * x.element_size()
    b_block = block_bytes(make_blocks(1, args.hidden, device), x)
    print(
        f"# activation checkpointing: L={L} blocks, input {args.tokens}×{args.hidden} fp32 on {device}, "
        f"torch {torch.__version__}, {args.threads} thread(s)"
    )
    print(f"# b_in = {b_in} B ({mib(b_in).strip()} MiB), b_block = {b_block} B ({mib(b_block).strip()} MiB)\n")

    times = time_rows(blocks, x, args.rounds, args.steps)
    print(f"## step time (forward + backward), {args.rounds} rounds × {args.steps} steps, ratio to plain per round")
    print(f"{'row':<34}{'median ms':>11}{'ratio median':>14}{'ratio IQR':>22}")
    for name, row_times in times.items():
        summary = summarize_ratios(row_times, times["plain"])
        ms = sorted(row_times)[len(row_times) // 2] * 1e3
        iqr = f"[{summary.q25:.3f}, {summary.q75:.3f}]"
        print(f"{name:<34}{ms:>11.2f}{summary.median:>14.3f}{iqr:>22}")

    tracker = MemTracker()
    tracker.track_external(blocks, x)
    memory = {name: measure(tracker, forward, blocks, x) for name, forward in ROWS.items()}
    plain_peak = memory["plain"]["peak"]
    bound = (L * b_in + b_block) / (L * b_block)
    print("\n## activation memory (MemTracker, bytes above parameters + input + gradients)")
    print(f"{'row':<34}{'peak MiB':>10}{'of plain':>10}{'after fwd MiB':>15}")
    for name, row in memory.items():
        print(f"{name:<34}{mib(row['peak']):>10}{row['peak'] / plain_peak:>10.3f}{mib(row['after_forward']):>15}")
    ckpt_ratio = memory["checkpoint every block"]["peak"] / plain_peak
    verdict = "within" if ckpt_ratio <= bound + 0.05 else "OUTSIDE"
    print(
        f"bound for every block: (L·b_in + b_block)/(L·b_block) = {bound:.3f} (+0.05 → {bound + 0.05:.3f}); "
        f"measured {ckpt_ratio:.3f}: {verdict}"
    )

    if not args.no_partition:
        rows = partitioned_rows(args)
        whole = rows["checkpoint every block"]["after_forward"] - b_in  # less the output: the stored inputs
        print("\n## saved inputs on a 2-rank tensor axis (rank 0; after the forward, less the output)")
        print(f"{'row':<34}{'saved MiB':>10}{'of whole':>10}{'peak MiB':>10}")
        for name, row in rows.items():
            saved = row["after_forward"] - b_in
            print(f"{name:<34}{mib(saved):>10}{saved / whole:>10.3f}{mib(row['peak']):>10}")


if __name__ == "__main__":
    main(sys.argv[1:])
