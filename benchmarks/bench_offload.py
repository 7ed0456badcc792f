"""Offload building blocks: CPU Adam step time, and NVMe swap throughput against the disk's raw bandwidth.

    python benchmarks/bench_offload.py [--numel 50000000] [--rounds 7] [--swap-gib 1.0] [--swap-rounds 3]
                                       [--dir /path/on/nvme] [--block-mib 4] [--queue-depth 4] [--threads 2]

(a) Adam: one flat fp32 tensor of ``--numel`` elements with a gradient; rows are torch.optim.AdamW with its
default implementation (a per-tensor loop on the CPU), ``foreach=True``, ``fused=True``, and shardspeed's
``cpu_adamw_step`` (torch's fused kernel driven chunk by chunk). Each row owns its optimizer state; every round
times one step of each row, in an order that reverses from round to round, and per-round ratios to the fused
row are summarised by median and IQR (``stats.py``). Target: ours ≤ 1.05× fused.

(b) Swap: ``--swap-gib`` of fp32 tensors (64 MiB each) written through a ``TensorSwapper`` (all swap_outs in
flight, then fsync) and read back (all swap_ins in flight), against a dd-like baseline in the same directory and
the same I/O mode (O_DIRECT or buffered): one thread, sequential 8 MiB ``pwrite``s from one aligned buffer, then
fsync; sequential ``preadv``s back. In buffered mode both sides drop the file's pages before reading so neither
reads from the page cache. Goal: swapper ≥ 0.8× raw. Disk use: twice ``--swap-gib``, removed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from stats import median, summarize_ratios

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.cpu_adam import cpu_adamw_step
from shardspeed.offload.swapper import TensorSwapper, aligned_empty, probe_o_direct

ADAM_HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
RAW_REQUEST_BYTES = 8 << 20
SWAP_TENSOR_BYTES = 64 << 20


def _torch_row(param: torch.nn.Parameter, **flags: bool) -> Callable[[], None]:
    optimizer = torch.optim.AdamW([param], **ADAM_HYPER, **flags)
    return optimizer.step


def _ours_row(param: torch.nn.Parameter) -> Callable[[], None]:
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    state = {"step": 0}

    def step() -> None:
        state["step"] += 1
        with torch.no_grad():
            cpu_adamw_step(param.data, param.grad, exp_avg, exp_avg_sq, step=state["step"], **ADAM_HYPER)

    return step


def bench_adam(numel: int, rounds: int) -> None:
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-3
    rows = {
        "torch default": _torch_row(param),
        "torch foreach": _torch_row(param, foreach=True),
        "torch fused": _torch_row(param, fused=True),
        "shardspeed cpu_adamw_step": _ours_row(param),
    }
    for step in rows.values():  # warm-up: allocates each row's state
        step()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for round_index in range(rounds):
        order = list(rows) if round_index % 2 == 0 else list(reversed(rows))
        for name in order:
            start = time.perf_counter()
            rows[name]()
            times[name].append(time.perf_counter() - start)
    print(f"(a) AdamW step, {numel:,} fp32 elements, {torch.get_num_threads()} threads, {rounds} rounds")
    print(f"    {'row':<28}{'median ms':>10}  ratio to fused (median [IQR])")
    for name, samples in times.items():
        summary = summarize_ratios(samples, times["torch fused"])
        print(
            f"    {name:<28}{median(samples) * 1e3:>10.1f}  "
            f"{summary.median:.3f}× [{summary.q25:.3f}, {summary.q75:.3f}]"
        )


def _raw_round(directory: Path, total: int, direct: bool) -> tuple[float, float]:
    """dd-like sequential write then read of ``total`` bytes: (write seconds, read seconds)."""
    path = directory / "raw.bin"
    buffer = mmap.mmap(-1, RAW_REQUEST_BYTES)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        start = time.perf_counter()
        for offset in range(0, total, RAW_REQUEST_BYTES):
            os.pwrite(fd, view, offset)
        os.fsync(fd)
        write_seconds = time.perf_counter() - start
        if not direct:
            os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for offset in range(0, total, RAW_REQUEST_BYTES):
            os.preadv(fd, [view], offset)
        read_seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        view.release()
    return write_seconds, read_seconds


def _swapper_round(
    swapper: TensorSwapper, sources: list[torch.Tensor], outs: list[torch.Tensor]
) -> tuple[float, float]:
    start = time.perf_counter()
    handles = [swapper.swap_out(f"t{i}", tensor) for i, tensor in enumerate(sources)]
    for handle in handles:
        handle.wait()
    os.fsync(swapper._fd)
    write_seconds = time.perf_counter() - start
    if not swapper.direct_io:
        os.posix_fadvise(swapper._fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    handles = [swapper.swap_in(f"t{i}", out) for i, out in enumerate(outs)]
    for handle in handles:
        handle.wait()
    read_seconds = time.perf_counter() - start
    return write_seconds, read_seconds


def bench_swap(directory: Path, gib: float, rounds: int, settings: AioSettings) -> None:
    count = max(1, round(gib * 2**30 / SWAP_TENSOR_BYTES))
    total = count * SWAP_TENSOR_BYTES
    # page-aligned tensors (as stream_step's buffers are), so O_DIRECT reads and writes them without staging
    sources = [aligned_empty(SWAP_TENSOR_BYTES // 4).normal_() for _ in range(count)]
    outs = [aligned_empty(SWAP_TENSOR_BYTES // 4).zero_() for _ in range(count)]
    direct = probe_o_direct(directory)
    raw: list[tuple[float, float]] = []
    swapped: list[tuple[float, float]] = []
    with TensorSwapper(directory, TensorSwapper.bytes_needed([total], settings), settings) as swapper:
        for round_index in range(rounds):
            if round_index % 2 == 0:
                raw.append(_raw_round(directory, total, direct))
                swapped.append(_swapper_round(swapper, sources, outs))
            else:
                swapped.append(_swapper_round(swapper, sources, outs))
                raw.append(_raw_round(directory, total, direct))
        mode = swapper.io_mode
    assert all(torch.equal(source, out) for source, out in zip(sources, outs)), "swap round trip corrupted data"
    print(
        f"(b) swap {total / 2**30:.2f} GiB in {count} tensors of 64 MiB, dir {directory}, mode {mode}, {rounds} rounds"
    )
    print(
        f"    swapper aio: block_size={settings.block_size >> 20} MiB, queue_depth={settings.queue_depth}, "
        f"thread_count={settings.thread_count}, single_submit={settings.single_submit}; raw: 1 thread, 8 MiB requests"
    )
    for column, label in ((0, "write"), (1, "read")):
        raw_bw = [total / 2**30 / times[column] for times in raw]
        swap_bw = [total / 2**30 / times[column] for times in swapped]
        summary = summarize_ratios(swap_bw, raw_bw)
        print(
            f"    {label:<6} raw {median(raw_bw):6.2f} GiB/s   swapper {median(swap_bw):6.2f} GiB/s   "
            f"ratio {summary.median:.3f}× [IQR {summary.q25:.3f}, {summary.q75:.3f}]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--swap-gib", type=float, default=1.0)
    parser.add_argument("--swap-rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--block-mib", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", choices=["adam", "swap"], default=None)
    args = parser.parse_args()
    if args.skip != "adam":
        bench_adam(args.numel, args.rounds)
    if args.skip != "swap":
        settings = AioSettings(block_size=args.block_mib << 20, queue_depth=args.queue_depth, thread_count=args.threads)
        directory = Path(tempfile.mkdtemp(prefix="bench_offload_", dir=args.dir))
        try:
            bench_swap(directory, args.swap_gib, args.swap_rounds, settings)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
