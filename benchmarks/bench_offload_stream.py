"""The NVMe-streamed optimizer step under different ``offload_optimizer`` settings, against the default.

    python benchmarks/bench_offload_stream.py [--numel 100000000] [--chunk 4194304] [--rounds 5] [--dir /path/on/nvme]

One fp32 tensor of ``--numel`` elements, its Adam state in a swap file, stepped by ``StreamedAdam`` in
``--chunk``-element sub-groups. Rows:
- step time with ``buffer_count`` 3 (one sub-group in flight: read, step, write in turn), 6, 9 (the default: read
  next ‖ step this ‖ write previous) and 15, each as a per-round ratio to the default row;
- start-up time (writing the initial state) with and without ``fast_init``, and the first step after each.
Each row owns its own swap file; rows run in an order that reverses every round; medians and IQRs of the
per-round ratios are printed (stats.py). Disk use: about 12 bytes per element per row.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from stats import median, summarize_ratios

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shardspeed.config.offload import OffloadOptimizerConfig
from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.optimizer import StreamedAdam
from shardspeed.offload.swapper import TensorSwapper, aligned_empty

SETTINGS = AioSettings()  # the defaults: 4 MiB blocks, 2 threads


def _optimizer(numel: int, chunk: int, directory: Path, offload: OffloadOptimizerConfig) -> tuple[StreamedAdam, float]:
    """A StreamedAdam over one fresh tensor; also the seconds its start-up (initial state written) took."""
    param = aligned_empty(numel).normal_()
    param.grad = aligned_empty(numel).normal_()
    inner = torch.optim.AdamW([param], lr=1e-3)
    swapper = TensorSwapper(directory, StreamedAdam.bytes_needed(inner, chunk, SETTINGS), SETTINGS)
    start = time.perf_counter()
    optimizer = StreamedAdam(inner, swapper, chunk, offload=offload)
    swapper.flush()
    return optimizer, time.perf_counter() - start


def _timed_step(optimizer: StreamedAdam) -> float:
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--chunk", type=int, default=1 << 22)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: temp)")
    args = parser.parse_args()
    torch.manual_seed(0)
    directory = Path(tempfile.mkdtemp(prefix="bench_stream_", dir=args.dir))
    counts = {"buffer_count=3": 3, "buffer_count=6": 6, "buffer_count=9 (default)": 9, "buffer_count=15": 15}
    try:
        steps: dict[str, list[float]] = {label: [] for label in counts}
        optimizers = {
            label: _optimizer(args.numel, args.chunk, directory, OffloadOptimizerConfig(buffer_count=count))[0]
            for label, count in counts.items()
        }
        order = list(counts)
        for round_index in range(args.rounds):
            for label in order if round_index % 2 == 0 else order[::-1]:
                steps[label].append(_timed_step(optimizers[label]))
        for optimizer in optimizers.values():
            optimizer.close()
        init: dict[bool, list[float]] = {False: [], True: []}
        first: dict[bool, list[float]] = {False: [], True: []}
        for round_index in range(args.rounds):
            for fast in (False, True) if round_index % 2 == 0 else (True, False):
                optimizer, seconds = _optimizer(
                    args.numel, args.chunk, directory, OffloadOptimizerConfig(fast_init=fast)
                )
                init[fast].append(seconds)
                first[fast].append(_timed_step(optimizer))
                optimizer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gib = args.numel * 12 / 2**30
    print(f"streamed AdamW step: {args.numel:,} elements ({gib:.2f} GiB of state), chunk {args.chunk:,}, "
          f"{args.rounds} rounds, dir {directory.parent}")  # fmt: skip
    default = steps["buffer_count=9 (default)"]
    for label, times in steps.items():
        summary = summarize_ratios(times, default)
        print(f"  {label:<26} step {median(times):6.2f} s   vs default {summary.median:.3f}× "
              f"[IQR {summary.q25:.3f}, {summary.q75:.3f}]")  # fmt: skip
    for label, rows in (("start-up", init), ("first step", first)):
        summary = summarize_ratios(rows[True], rows[False])
        print(f"  fast_init {label:<11} {median(rows[True]):6.2f} s vs {median(rows[False]):6.2f} s without: "
              f"{summary.median:.3f}× [IQR {summary.q25:.3f}, {summary.q75:.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
