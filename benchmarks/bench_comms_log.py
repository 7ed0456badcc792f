"""The comms log against ZeRO's traffic theory, per stage, and what logging costs.

    python benchmarks/bench_comms_log.py [--nproc 2] [--steps 3] [--model small] [--stages 0,1,2,3]

For each ZeRO stage an engine trains the benchmarks' GPT (fp32, AdamW, gloo on CPU; stage 3 with
``stage3_param_persistence_threshold: 0``) with ``comms_logger`` on: one warm-up step (it records the gradients'
arrival order), the log reset, then ``--steps`` steps. Printed per stage: Ψ, the data-parallel elements per rank
per step the log counted (tags ``grads`` / ``params`` over the data axis), ZeRO's theory and their ratio
(deterministic: padding to the world size only), and the gradient reduction's mean latency and bus bandwidth
(wall-clock figures, indicative on a shared machine); then rank 0's full summary of the last stage. Also: the
cost of one logged call's bookkeeping (``record`` + its completion timer), timed in-process, and the step time
with the log on and off (median of the timed steps; noisy). Nothing asserts a time.

Run plainly, this script is the launcher: it starts itself under ``torch.distributed.run``. About a minute on 2
busy cores.
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="logged steps per stage (default 3)")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default small)")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (default 0,1,2,3)")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.steps < 1:
        parser.error("--nproc must be at least 2 and --steps at least 1")
    args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    if not args.stage_list or any(s not in (0, 1, 2, 3) for s in args.stage_list):
        parser.error(f"--stages must list stages 0-3, got {args.stages!r}")
    return args


def bookkeeping_ns(calls: int = 200_000) -> float:
    """Nanoseconds of one logged call's bookkeeping: ``record`` and its completion timer."""
    from shardspeed.comm.log import CommsLog

    log = CommsLog(enabled=True)
    started = time.perf_counter()
    for _ in range(calls):
        log.record("all_gather", 4096, 4, 2, "params", "data")()
    return (time.perf_counter() - started) / calls * 1e9


# --- launcher -----------------------------------------------------------------------------------------------
def launcher_main(args: argparse.Namespace, argv: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_comms_log_") as scratch:
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
        if subprocess.run(command, env=child_env(), check=False).returncode != 0:
            raise SystemExit("bench_comms_log: the run failed; see its output above")
        report = json.loads(result.read_text())
    print(
        f"\nbench_comms_log: {report['model']}, fp32, AdamW, gloo on CPU, {report['world']} ranks, "
        f"{args.steps} logged steps per stage, torch {torch.__version__}\n"
    )
    head = f"{'stage':<7}{'Ψ':>12}{'logged/step':>14}{'theory/step':>14}{'ratio':>8}"
    print(head + f"{'grads mean ms':>15}{'grads busbw Gbps':>18}{'step ms off':>13}{'step ms on':>12}")
    for stage, row in report["stages"].items():
        print(
            f"{stage:<7}{row['psi']:>12,}{row['measured']:>14,.0f}{row['theory']:>14,.0f}{row['ratio']:>8.3f}"
            f"{row['grads_ms']:>15.2f}{row['grads_busbw']:>18.3f}{row['off_ms']:>13.1f}{row['on_ms']:>12.1f}"
        )
    print(f"\nrank 0's summary, stage {list(report['stages'])[-1]}:\n{report['summary']}")
    print(f"\nbookkeeping per logged call (record + completion timer, in-process): {bookkeeping_ns():.0f} ns")
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"
    print(f"(1-minute load average {load} on {os.cpu_count()} CPUs; times are indicative)")


# --- ranks --------------------------------------------------------------------------------------------------
def _steps(engine: Any, setup: BenchSetup, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        loss = engine(setup.inputs, setup.targets)
        engine.backward(loss)
        engine.step()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def _engine(setup: BenchSetup, stage: int, logged: bool) -> Any:
    import shardspeed

    zero_extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    config = engine_config(setup, stage, zero_extra, {"comms_logger": {"enabled": logged}})
    engine, *_ = shardspeed.initialize(model=setup.fresh_model(), config=config)
    return engine


def rank_main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    setup = make_setup(MODEL_SIZES[args.model], rank)
    stages, summary = {}, ""
    for stage in args.stage_list:
        row: dict[str, Any] = {}
        for logged in (False, True):
            engine = _engine(setup, stage, logged)
            _steps(engine, setup, 1)
            engine.comms_log.reset()
            times = sorted(_steps(engine, setup, args.steps))
            row["on_ms" if logged else "off_ms"] = times[len(times) // 2]
            if logged:
                if stage in (1, 2):  # land the last step's overlapped gathers (at stage 3 this would gather more)
                    engine.module_state_dict()
                log = engine.comms_log
                grads = next(t for k, t in log.totals.items() if k.endswith(":grads"))
                theory = log.theory
                measured = log.data_parallel_elements() / log.steps
                row.update(
                    psi=theory.numel,
                    measured=measured,
                    theory=theory.elements_per_step,
                    ratio=measured / theory.elements_per_step,
                    grads_ms=grads.mean_latency_ms or 0.0,
                    grads_busbw=grads.busbw_gbps or 0.0,
                )
                summary = log.summary()
            engine.destroy()
        stages[str(stage)] = row
    if rank == 0 and args.result_file:
        report = {"model": setup.model_description, "world": dist.get_world_size(), "stages": stages}
        Path(args.result_file).write_text(json.dumps({**report, "summary": summary}))
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
