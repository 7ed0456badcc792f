"""End-to-end step time of 1-bit Adam (compressed phase) against plain Adam (ZeRO stage 0) on a SIMULATED link.

    python benchmarks/bench_compression_speed.py [--nproc 2] [--bandwidths 0.1,1,10] [--rounds 5] [--steps 4]
                                                 [--model mlp] [--micro-batch N] [--latency-us 50]
                                                 [--device cpu|cuda]

SIMULATION: a CPU host's gloo over shared memory is not a network, so every collective is made to complete only
after its algorithmic bytes would have crossed the rank's one link of the given bandwidth (calls in flight,
e.g. Adam's gradient buckets, share it) plus a latency (``communication.simulated_link``, [Note: simulated
link] in comm/simulated_link.py; compute between launch and wait overlaps the simulated transfer as it would a
real one). The figures say what the traffic reduction buys where bandwidth is the bottleneck, not what a real
cluster measures.

Rows, per bandwidth: ``adam`` (config "Adam", stage 0: bucketed fp32 gradient all-reduce overlapping backward) and
``onebit`` (config "OneBitAdam", ``freeze_step`` 3, timed in its compressed phase: no gradient all-reduce, one
error-fed 1-bit all-reduce of the momentum per step). Model: the comm-bound MLP of benchmarks/bench_models.py
(6 × Linear(1024, 1024), 6.3M parameters, batch 32; ``--micro-batch 1`` leaves so little compute per
parameter that the step is bound by the gradient all-reduce: the genuinely comm-bound setting), fp32, gloo on
CPU. Each round times ``--steps`` steps of
each row (rows alternate within a round, so drifts in machine load hit both); a round's figure is its median
step. Printed: per bandwidth, each row's median step time (IQR over rounds) and the per-round ratio
onebit / adam (median and IQR), plus each row's data-axis bytes per rank per step from the comms log.

``--device cuda`` (``make gpu-check``'s ``bench-compression-cuda``): the same rows with the model, gradients,
optimizer states and the compression's element-wise work on the GPU — where that work costs ~100× less per
element than on one CPU thread, which is what decides the 10 Gbit/s row ([Note: simulated link]). With a GPU per
rank the ranks run NCCL; with fewer GPUs than ranks (one GPU: NCCL refuses two ranks on a device) they run gloo,
both on ``cuda:0``, gloo staging each collective through host memory (it implements all-reduce, all-gather and
all-to-all for CUDA tensors). The link is simulated either way, so the figures compare the rows, not a network.
Not yet run on a GPU: no session had one when it was written.

Run plainly, this script is the launcher: it starts itself under ``torch.distributed.run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_models import MODEL_SIZES, BenchSetup, MLPSize, make_setup
from launch_util import child_env, free_port
from stats import interquartile_range, median, summarize_ratios

ROWS = ("adam", "onebit")
FREEZE = 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--bandwidths", default="0.1,1,10", help="simulated link speeds in Gbit/s (default 0.1,1,10)")
    parser.add_argument("--latency-us", type=float, default=50.0, help="simulated latency per call (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row per round (default 4)")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="mlp", help="model (default mlp)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="rows per rank for the mlp (default: the model's 32); 1 makes the step communication-bound",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (see above)")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.rounds < 1 or args.steps < 1:
        parser.error("--nproc must be at least 2, --rounds and --steps at least 1")
    if args.micro_batch is not None and (args.micro_batch < 1 or not isinstance(MODEL_SIZES[args.model], MLPSize)):
        parser.error("--micro-batch takes a positive row count, for the mlp model only")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__})")
    args.bandwidth_list = [float(b) for b in args.bandwidths.split(",") if b.strip()]
    return args


# --- launcher -----------------------------------------------------------------------------------------------
def launcher_main(args: argparse.Namespace, argv: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_compression_speed_") as scratch:
        result = Path(scratch) / "result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nproc_per_node", str(args.nproc), "--master_port", str(free_port())),
            str(Path(__file__).resolve()),
            *argv,
            *("--result-file", str(result)),
        ]
        if subprocess.run(command, env=child_env(cpu_only=args.device == "cpu"), check=False).returncode != 0:
            raise SystemExit("bench_compression_speed: the run failed; see its output above")
        report = json.loads(result.read_text())
    print(
        f"\nbench_compression_speed — SIMULATED LINK (not a real network): {report['model']}, fp32, stage 0, "
        f"{report['placement']}, world {report['world']}, latency {args.latency_us:g} µs/call, {args.rounds} rounds × "
        f"{args.steps} steps, torch {torch.__version__}\n"
    )
    print(f"{report['params']:,} parameters.")
    print(
        f"{'link':>9}{'row':>8}{'step ms':>10}{'IQR':>18}{'data bytes/step/rank':>23}{'wire ms':>9}"
        f"{'onebit/adam':>13}{'IQR':>16}"
    )
    for gbps, block in report["links"].items():
        ratio = summarize_ratios(block["onebit"]["rounds"], block["adam"]["rounds"])
        for row in ROWS:
            times = block[row]["rounds"]
            q25, q75 = interquartile_range(times)
            tail = f"{ratio.median:>13.3f}{f'[{ratio.q25:.3f}, {ratio.q75:.3f}]':>16}" if row == "onebit" else ""
            print(
                f"{gbps + ' Gb/s':>9}{row:>8}{median(times):>10.1f}{f'[{q25:.1f}, {q75:.1f}]':>18}"
                f"{block[row]['bytes_per_step']:>23,.0f}{wire_ms(block[row]['bytes_per_step'], gbps):>9.1f}{tail}"
            )
    print(
        "\nratio < 1: 1-bit Adam's step is faster. Bytes: algorithmic bytes per rank over the data axis (comms log); "
        "wire ms: those bytes at the link's bandwidth (the simulated transfer time per step, latency excluded)."
    )
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"
    print(f"(1-minute load average {load} on {os.cpu_count()} CPUs)")


def wire_ms(nbytes: float, gbps: str) -> float:
    """Milliseconds ``nbytes`` take on a link of ``gbps`` Gbit/s (what the simulated link charges, less latency)."""
    return nbytes * 8 / (float(gbps) * 1e9) * 1e3


# --- ranks --------------------------------------------------------------------------------------------------
def _config(setup: BenchSetup, row: str, gbps: float, latency_us: float) -> dict[str, Any]:
    optimizer = (
        {"type": "Adam", "params": {"lr": 1e-4}}
        if row == "adam"
        # a short warm-up leaves a tiny frozen variance: small lr and a larger eps keep the timed steps finite
        else {"type": "OneBitAdam", "params": {"lr": 1e-6, "eps": 1e-4, "freeze_step": FREEZE}}
    )
    return {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 0},
        "communication": {"simulated_link": {"bandwidth_gbps": gbps, "latency_us": latency_us}},
        "comms_logger": {"enabled": True},
        "steps_per_print": 10**9,
    }


def _step(engine: Any, setup: BenchSetup) -> float:
    started = time.perf_counter()
    loss = engine(setup.inputs, setup.targets)
    engine.backward(loss)
    engine.step()
    if setup.device.type == "cuda":  # the step's kernels finished, not just queued
        torch.cuda.synchronize(setup.device)
    return (time.perf_counter() - started) * 1e3


def placement(device: str, world: int, gpus: int) -> tuple[str, str, int | None]:
    """(backend, a label, the local GPU index every rank uses or None for its own) for ``--device``: gloo on CPU;
    NCCL with a GPU per rank; else gloo with every rank on ``cuda:0`` (NCCL refuses two ranks on one GPU)."""
    if device == "cpu":
        return "gloo", "gloo on CPU", None
    if gpus < 1:
        raise SystemExit("bench_compression_speed --device cuda: no CUDA device is visible")
    if gpus >= world:
        return "nccl", "NCCL, one GPU per rank", None
    return "gloo", f"gloo, all {world} ranks on cuda:0 ({gpus} GPU)", 0


def rank_main(args: argparse.Namespace) -> None:
    import shardspeed

    world = int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend, label, shared = placement(args.device, world, gpus)
    if shared is not None:  # the engine places each rank on its LOCAL_RANK's GPU: make it the shared one
        os.environ["LOCAL_RANK"] = str(shared)
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    size = MODEL_SIZES[args.model]
    if args.micro_batch is not None:
        size = dataclasses.replace(size, micro_batch=args.micro_batch)
    setup = make_setup(size, rank, device)
    params = sum(p.numel() for p in setup.fresh_model().parameters())
    links: dict[str, Any] = {}
    for gbps in args.bandwidth_list:
        engines = {}
        for row in ROWS:
            engine, *_ = shardspeed.initialize(
                model=setup.fresh_model(), config=_config(setup, row, gbps, args.latency_us)
            )
            for _ in range(3):  # layout recording, warm-up; OneBitAdam is in its compressed phase after step 2
                _step(engine, setup)
            assert row == "adam" or engine.optimizer.owns_communication
            engine.comms_log.reset()
            engines[row] = engine
        block: dict[str, Any] = {row: {"rounds": []} for row in ROWS}
        for _ in range(args.rounds):
            for row in ROWS:
                times = [_step(engines[row], setup) for _ in range(args.steps)]
                block[row]["rounds"].append(median(times))
        for row in ROWS:
            log = engines[row].comms_log
            data_bytes = sum(t.algorithmic_bytes for t in log.totals.values() if "data" in t.axis_elements)
            block[row]["bytes_per_step"] = data_bytes / max(log.steps, 1)
            if engines[row].skipped_steps:  # a skipped step runs no optimizer: its time would flatter the row
                raise RuntimeError(f"{row}: {engines[row].skipped_steps} non-finite steps skipped; timings invalid")
            engines[row].destroy()
        links[f"{gbps:g}"] = block
    if rank == 0 and args.result_file:
        report = {
            "model": setup.model_description,
            "params": params,
            "world": dist.get_world_size(),
            "placement": label,
            "links": links,
        }
        Path(args.result_file).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        rank_main(args)
    else:
        launcher_main(args, [a for a in argv])


if __name__ == "__main__":
    main()
