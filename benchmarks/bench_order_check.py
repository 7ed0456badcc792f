"""Cost of collective-order verification (``fault_tolerance.verify_collective_order``): step time on / off.

    python benchmarks/bench_order_check.py [--nproc 2] [--rounds 5] [--steps 3] [--warmup 1]
                                           [--model small|medium] [--stages 0,1,2,3]

For each ZeRO stage two engines train the same small model (the benchmarks' GPT, fp32, AdamW, gloo on CPU;
stage 3 with ``stage3_param_persistence_threshold: 0`` so every parameter is gathered): one verifying every
collective, one not. Each round times ``--steps`` steps of every engine back to back (the order reversing from
round to round); the per-round ratio on/off is summarised by its median and IQR (``stats.py``). The issue's
budget is a ratio of at most 2; nothing asserts it (timings on a shared machine are not test material).

Also printed: how many collectives each step verified (each costs one extra all-gather of one int64 per rank,
plus a blocking wait that removes the overlap of asynchronous reductions and prefetches).

Run plainly, this script is the launcher: it starts itself under ``torch.distributed.run``. The defaults take
about 4 minutes on 2 busy cores. One run (2 ranks, load average ~18 on 2 CPUs, 5 rounds x 3 steps): on/off
median 0.95 (stage 0), 1.15 (1), 1.09 (2), 1.27 (3, 43 checks per step).
"""

from __future__ import annotations

import argparse
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
from bench_rows import MODEL_SIZES, BenchSetup, engine_config, make_setup
from launch_util import child_env, free_port
from stats import summarize_ratios


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine per round (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per engine first (default 1)")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default small)")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (default 0,1,2,3)")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("nproc", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    if not args.stage_list or any(s not in (0, 1, 2, 3) for s in args.stage_list):
        parser.error(f"--stages must list stages 0-3, got {args.stages!r}")
    return args


# --- launcher -----------------------------------------------------------------------------------------------
def launcher_main(args: argparse.Namespace, argv: list[str]) -> None:
    env = child_env(unset=["SHARDSPEED_VERIFY_COLLECTIVES"])  # the benchmark sets the option per engine itself
    with tempfile.TemporaryDirectory(prefix="bench_order_") as scratch:
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
        if subprocess.run(command, env=env, check=False).returncode != 0:
            raise SystemExit("bench_order_check: the timing run failed; see its output above")
        report = json.loads(result.read_text())
    print(
        f"\nbench_order_check: {report['model']}, fp32, AdamW, gloo on CPU, {report['world']} ranks, "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}\n"
    )
    print(f"{'stage':<8}{'off ms':>10}{'on ms':>10}{'on/off median':>16}{'IQR':>18}{'checks/step':>14}")
    for stage, row in report["stages"].items():
        summary = summarize_ratios(row["on_ms"], row["off_ms"])
        off = sorted(row["off_ms"])[len(row["off_ms"]) // 2]
        on = sorted(row["on_ms"])[len(row["on_ms"]) // 2]
        iqr = f"{summary.q25:.2f}-{summary.q75:.2f}"
        print(f"{stage:<8}{off:>10.1f}{on:>10.1f}{summary.median:>16.2f}{iqr:>18}{row['checks_per_step']:>14.1f}")
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"
    print(f"\n(1-minute load average {load} on {os.cpu_count()} CPUs; budget: on/off <= 2)")


# --- ranks --------------------------------------------------------------------------------------------------
def _build(setup: BenchSetup, stage: int, verify: bool) -> Any:
    import shardspeed

    zero_extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    config = {**engine_config(setup, stage, zero_extra), "fault_tolerance": {"verify_collective_order": verify}}
    engine, *_ = shardspeed.initialize(model=setup.fresh_model(), config=config)
    return engine


def _steps(engine: Any, setup: BenchSetup, count: int) -> float:
    """Seconds for ``count`` steps on the slowest rank (between two barriers)."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(count):
        loss = engine(setup.inputs, setup.targets)
        engine.backward(loss)
        engine.step()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def rank_main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    setup = make_setup(MODEL_SIZES[args.model], rank)
    engines = {(s, v): _build(setup, s, v) for s in args.stage_list for v in (False, True)}
    for engine in engines.values():
        _steps(engine, setup, args.warmup)
    times: dict[tuple[int, bool], list[float]] = {key: [] for key in engines}
    checks: dict[int, int] = {s: 0 for s in args.stage_list}
    order = list(engines)
    for round_index in range(args.rounds):
        for key in order if round_index % 2 == 0 else reversed(order):
            before = engines[key].collectives.order.checked if key[1] else 0
            times[key].append(_steps(engines[key], setup, args.steps) * 1000.0 / args.steps)
            if key[1]:
                checks[key[0]] += engines[key].collectives.order.checked - before
    if rank == 0 and args.result_file:
        report = {
            "model": setup.model_description,
            "world": dist.get_world_size(),
            "stages": {
                str(s): {
                    "off_ms": times[(s, False)],
                    "on_ms": times[(s, True)],
                    "checks_per_step": checks[s] / (args.rounds * args.steps),
                }
                for s in args.stage_list
            },
        }
        Path(args.result_file).write_text(json.dumps(report))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ:
        rank_main(args)
    else:
        launcher_main(args, argv)


if __name__ == "__main__":
    main()
