"""Scale demo (a benchmark, not a test): the largest model this machine trains for one step with ZeRO-3 + NVMe
offload, against plain DDP's limit from the memory model, confirmed by a DDP step at 90% of that limit.

    python benchmarks/bench_scale.py [--hidden 8192] [--layers 12] [--nproc 2] [--swap-dir DIR] [--skip-ddp]
    python benchmarks/bench_scale.py --largest [--hidden 8192] [--swap-dir /tmp] [--disk-headroom 0.15]

The NVMe run uses benchmarks/offload_worker.py (fp32 Adam, ZeRO-3, offload_param + offload_optimizer nvme,
one unit resident at a time; gradients written behind to the swap file as they are reduced, so host memory does
not grow with the model). ``--largest`` sizes the model from the swap directory's free disk space instead:
``DISK_BYTES_PER_PARAM`` = 20 (fp32 values in the parameter swap file; fp32 values, Adam's m and v and the
gradient in the optimizer's), leaving ``--disk-headroom`` of the free space plus 5 GiB unused, rounds down to whole
``--hidden``-wide layers and trains one step; it prints where the step's time went (forward, backward, optimizer:
blocked on reads / CPU Adam / blocked on writes; swap-file I/O) and skips the DDP confirmation (it would allocate
most of this machine's memory) unless ``--confirm-ddp``.

DDP's limit: every process holds 16 bytes of model states per parameter (fp32 params, grads, Adam momentum +
variance), so Ψ_max = (MemAvailable − headroom − N·baseline) / (16·N). The DDP confirmation never probes for the
OOM: it trains one step at 90% of Ψ_max.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_util import child_env, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30
DISK_BYTES_PER_PARAM = 4 + 4 * 4
"""fp32 parameter shard (offload_param's file) + fp32 values, exp_avg, exp_avg_sq and gradient (offload_optimizer's)."""


def _torchrun(nproc: int, script: Path, *args: str) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(free_port()), str(script), *args]
    # no MALLOC_MMAP_THRESHOLD_ in the environment: NVMe offload pins it itself
    subprocess.run(cmd, check=True, env=child_env(force_one_thread=True))
    return time.perf_counter() - start


def mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


DDP_WORKER = """
import sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
hidden, layers = int(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)  # fused: no full-size temporaries
start = time.perf_counter()
ddp(torch.randn(4, hidden)).pow(2).mean().backward()
opt.step()
peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
if dist.get_rank() == 0:
    print(f"DDP step ok: {time.perf_counter() - start:.1f} s, peak RSS {int(peak) / 2**20:.1f} GiB/rank", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _where_time_went(parts: dict[str, float]) -> str:
    """One line: the step's phases, the optimizer's stream (waits, Adam) and the swap files' I/O."""
    line = (
        f"forward {parts['forward_s']:.1f} s, backward {parts['backward_s']:.1f} s, optimizer "
        f"{parts['optimizer_s']:.1f} s (blocked on reads {parts['opt_wait_read_s']:.1f}, CPU Adam + write-back "
        f"{parts['opt_adam_s']:.1f}, blocked on writes {parts['opt_wait_write_s']:.1f})"
    )
    for store in ("params", "opt"):
        if f"{store}_read_bytes" in parts:
            line += (
                f"; {store} swap: read {parts[f'{store}_read_bytes'] / 1e9:.2f} GB in {parts[f'{store}_io_read_s']:.1f}"
                f" s, wrote {parts[f'{store}_write_bytes'] / 1e9:.2f} GB in {parts[f'{store}_io_write_s']:.1f} s"
            )
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--swap-dir", default=None)
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--headroom-gib", type=float, default=2.0)
    parser.add_argument("--largest", action="store_true", help="size the model from the free disk space")
    parser.add_argument("--disk-headroom", type=float, default=0.15, help="fraction of free disk left unused")
    parser.add_argument("--confirm-ddp", action="store_true", help="with --largest: still run the DDP step")
    parser.add_argument("--grads", choices=("nvme", "ram"), default="nvme", help="where gradient shards live")
    parser.add_argument("--fast-init", action="store_true", help="offload_optimizer.fast_init (--largest: on)")
    args = parser.parse_args()

    swap_root = args.swap_dir or tempfile.gettempdir()
    if args.largest:
        free = shutil.disk_usage(swap_root).free
        budget = free * (1 - args.disk_headroom) - 5 * GIB
        per_layer = args.hidden * (args.hidden + 1)
        args.layers = max(1, int(budget // (DISK_BYTES_PER_PARAM * per_layer)))
        print(
            f"disk: {free / 1e9:.1f} GB free under {swap_root}; {DISK_BYTES_PER_PARAM} bytes per parameter on disk "
            f"(fp32 param shard + fp32 values, Adam m, v and gradient); leaving {args.disk_headroom:.0%} + 5 GiB "
            f"-> {args.layers} layers of {args.hidden} x {args.hidden + 1}"
        )
        # No memory cap: construction hands each unit's shard to the swap file as it is materialized ([Note:
        # offload during construction]), so host memory does not grow with the model; only the disk does.
        args.skip_ddp = args.skip_ddp or not args.confirm_ddp
        args.fast_init = True  # Adam's zero moments (8 of the 20 bytes per parameter) are not written at start
    params = args.layers * args.hidden * (args.hidden + 1)
    print(
        f"NVMe offload: {params / 1e9:.2f}B parameters, fp32 Adam model states {16 * params / GIB:.1f} GiB, "
        f"{DISK_BYTES_PER_PARAM * params / 1e9:.1f} GB on disk, gradients in {args.grads}"
    )
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap, tempfile.TemporaryDirectory() as out:
        worker_args = [out, swap, str(args.hidden), str(args.layers), "1", "--grads", args.grads]
        worker_args += ["--fast-init"] if args.fast_init else []
        wall = _torchrun(args.nproc, HERE / "offload_worker.py", *worker_args)
        for rank in range(args.nproc):
            report = json.loads((Path(out) / f"rank{rank}.json").read_text())
            peak = (report["peak_kib"] - report["baseline_kib"]) / 2**20
            train = (report["train_peak_kib"] - report["baseline_kib"]) / 2**20
            print(
                f"  rank {rank}: peak RssAnon above baseline {peak:.2f} GiB (whole run, construction included), "
                f"while training {train:.2f} GiB; step "
                f"{report['step_seconds'][0]:.1f} s, loss {report['losses'][0]:.4f}"
            )
            print("    " + _where_time_went(report["breakdown"][0]))
        print(f"  whole run (launch, zero.Init materialization, swap-file writes, step): {wall:.0f} s")

    available = mem_available()
    baseline = 0.35 * GIB  # torch + shardspeed imported, per process (measured by the worker: ~0.3-0.4 GiB)
    usable = available - args.headroom_gib * GIB - args.nproc * baseline
    ddp_limit = int(usable / (16 * args.nproc))
    print(
        f"DDP limit from the memory model: MemAvailable {available / GIB:.1f} GiB, {args.nproc} processes x 16 B "
        f"per parameter -> {ddp_limit / 1e9:.2f}B parameters; NVMe offload trained {params / ddp_limit:.1f}x that"
    )
    if not args.skip_ddp:
        layers = max(1, int(0.9 * ddp_limit / (args.hidden * (args.hidden + 1))))
        confirm = layers * args.hidden * (args.hidden + 1)
        print(f"confirming DDP at {confirm / ddp_limit:.0%} of its limit ({confirm / 1e9:.2f}B parameters) ...")
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(DDP_WORKER)
        try:
            _torchrun(args.nproc, Path(f.name), str(args.hidden), str(layers))
        finally:
            os.unlink(f.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
