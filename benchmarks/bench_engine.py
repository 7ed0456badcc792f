"""Side-by-side training speed and memory: shardspeed against torch peers (and DeepSpeed when installed).

    python benchmarks/bench_engine.py [--nproc 2] [--rounds 7] [--steps 10] [--warmup 3]
                                      [--model small|medium] [--rows stage0,ddp,...]

The default runs every row (shardspeed stages 0-3 against torch DDP, ZeroRedundancyOptimizer and FSDP2) in
about 3-4 minutes on a 2-core machine. For tighter ratios run longer: ``--rounds 15`` (about twice the timing
time), or ``--rows stage3,stage3_nopersist --rounds 15`` to study one comparison; ``--model medium`` makes
tensors large enough that stage 3's default persistence threshold partitions them.

Run plainly, this script is the launcher: it starts itself under ``torch.distributed.run`` (gloo on CPU, one
thread per rank) once for the timing run and once per row for the memory runs, then prints the table.

Timing: every row is built in one set of processes, then timed in rounds. Each round times ``--steps`` steps
of every row back to back, in an order that reverses from round to round so slow drift of the machine does not
favour the row that always runs first. The per-round ratio row/peer is summarised by its median and IQR
(``stats.py``).

Memory: VmHWM, the kernel's per-process peak RSS, cannot be split between rows that share a process, so each
row's peak comes from a fresh torchrun that builds only that row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_report import format_report
from bench_rows import (
    DEEPSPEED_ROWS,
    DEFAULT_ROWS,
    MODEL_SIZES,
    ROWS,
    BenchSetup,
    Row,
    StepFn,
    deepspeed_installed,
    make_setup,
    resolve_rows,
)
from proc_status import read_status_mib

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) per run (default 2)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per row (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row per round (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row after building it (default 3)")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default small)")
    parser.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows; peers are added as needed (valid: {', '.join(ROWS)}; "
        f"default {','.join(DEFAULT_ROWS)}, plus {','.join(DEEPSPEED_ROWS)} when deepspeed is installed)",
    )
    # Internal: how the launcher tells its torchrun children what to do.
    parser.add_argument("--memory-row", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("nproc", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    return args


def requested_rows(args: argparse.Namespace) -> list[str]:
    if args.rows is not None:
        return [name.strip() for name in args.rows.split(",") if name.strip()]
    return [*DEFAULT_ROWS, *(DEEPSPEED_ROWS if deepspeed_installed() else ())]


# --- launcher (no RANK in the environment) ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks x 1 thread on a 2-core machine: no oversubscription
    env["CUDA_VISIBLE_DEVICES"] = ""  # this is the CPU/gloo benchmark; keep every row on the same device
    src = str(REPO_ROOT / "src")  # works from a checkout without `pip install -e .`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def _torchrun(args: argparse.Namespace, rows: list[str], result_file: Path, memory_row: str | None) -> bool:
    """Run one torchrun child; True when it succeeded (and so wrote ``result_file``)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_port",
        str(_free_port()),
        str(Path(__file__).resolve()),
        *("--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--model", args.model, "--rows", ",".join(rows), "--result-file", str(result_file)),
        *(("--memory-row", memory_row) if memory_row else ()),
    ]
    completed = subprocess.run(command, env=_child_env(), check=False)
    if completed.returncode != 0:
        what = f"memory run for row {memory_row!r}" if memory_row else "timing run"
        print(f"bench_engine: the {what} failed (exit code {completed.returncode}); see its output above")
    return completed.returncode == 0


def _load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:  # not Linux
        return "n/a"


def launcher_main(args: argparse.Namespace) -> None:
    rows = [row.name for row in resolve_rows(requested_rows(args))]
    started, load_before = time.perf_counter(), _load_average()
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as scratch:
        timing_file = Path(scratch) / "timing.json"
        if not _torchrun(args, rows, timing_file, memory_row=None):
            raise SystemExit(1)
        timing = json.loads(timing_file.read_text())
        memory: dict[str, dict[str, Any] | None] = {}
        for name in timing["step_ms"]:  # rows that failed to build in the timing run are not measured again
            memory_file = Path(scratch) / f"memory_{name}.json"
            # A failed memory run costs that row's memory cell, not the timings already taken.
            ok = _torchrun(args, rows, memory_file, memory_row=name)
            memory[name] = json.loads(memory_file.read_text()) if ok else None
    print()
    print(
        f"bench_engine: {timing['model']} ({timing['parameters']:,} parameters), fp32, AdamW, gloo on CPU, "
        f"{timing['world']} ranks x {timing['threads']} thread(s), micro batch {timing['micro_batch']}, "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}"
    )
    if not any(name in DEEPSPEED_ROWS for name in rows):
        print("deepspeed: not installed" if not deepspeed_installed() else "deepspeed: installed, row not selected")
    print()
    print(format_report(timing, memory))
    print(
        f"\n(total wall time {time.perf_counter() - started:.0f} s; 1-minute load average {load_before} before, "
        f"{_load_average()} after, on {os.cpu_count()} CPUs: a load above the rank count means other processes "
        "competed for the cores)"
    )


# --- ranks (under torchrun) ------------------------------------------------------------------------------
def _all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build_row(row: Row, setup: BenchSetup) -> tuple[StepFn | None, str | None]:
    """(step, None), or (None, reason) when an optional row could not be built on every rank."""
    if not row.optional:
        return row.build(setup), None
    step, reason = None, None
    try:
        step = row.build(setup)
    except Exception as error:  # an optional row (DeepSpeed) must not take the whole benchmark down
        reason = f"{type(error).__name__}: {error}"
    if not _all_ranks_ok(step is not None):
        return None, reason or "failed to build on another rank"
    return step, None


def time_block(step: StepFn, steps: int) -> tuple[float, float]:
    """(mean ms per step on the slowest rank, last loss) for ``steps`` steps between two barriers."""
    dist.barrier()
    started = time.perf_counter()
    loss = torch.zeros(())
    for _ in range(steps):
        loss = step()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()) * 1000.0 / steps, float(loss)


def timing_run(args: argparse.Namespace, rows: list[Row], setup: BenchSetup) -> dict[str, Any]:
    rank = dist.get_rank()
    steppers: dict[str, StepFn] = {}
    skipped: dict[str, str] = {}
    for row in rows:
        step, reason = build_row(row, setup)
        if step is None:
            skipped[row.name] = reason or "failed to build"
            continue
        for _ in range(args.warmup):
            step()
        steppers[row.name] = step
    names = list(steppers)
    step_ms: dict[str, list[float]] = {name: [] for name in names}
    final_loss: dict[str, float] = {}
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            ms, final_loss[name] = time_block(steppers[name], args.steps)
            step_ms[name].append(ms)
        if rank == 0:
            progress = ", ".join(f"{name} {step_ms[name][-1]:.1f} ms" for name in order)
            print(f"round {round_index + 1}/{args.rounds} ({' then '.join(order)}): {progress}", flush=True)
    kept = [row for row in rows if row.name in steppers]
    return {
        "rows": [{"name": r.name, "description": r.description, "peer": r.peer} for r in kept],
        "step_ms": step_ms,
        "final_loss": final_loss,
        "skipped": skipped,
        "model": setup.model_description,
        "parameters": sum(p.numel() for p in setup.template.parameters()),
        "micro_batch": setup.micro_batch,
        "world": dist.get_world_size(),
        "threads": torch.get_num_threads(),
    }


def _trigger_torch_one_time_setup() -> None:
    """Pay torch's lazy one-time costs (the optimizer's first-use imports, the autograd engine's threads).

    They come to tens of MiB and every row pays them alike; paying them before the baseline keeps them out of
    each row's growth, which is then about the row's own tensors and buffers.
    """
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight])
    (weight * 2.0).sum().backward()
    optimizer.step()


def memory_run(args: argparse.Namespace, rows: list[Row], row: Row, setup: BenchSetup) -> dict[str, Any]:
    """VmHWM per rank before and after building ``row`` and running warmup + steps steps with it."""
    for each in rows:  # the same modules in every row's process: imports cost every row the same
        each.preload()
    _trigger_torch_one_time_setup()
    baseline = read_status_mib("VmHWM")
    step, reason = build_row(row, setup)
    if step is None:
        raise RuntimeError(f"row {row.name!r} failed to build in its memory run: {reason}")
    for _ in range(args.warmup + args.steps):
        step()
    peak = read_status_mib("VmHWM")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (baseline, peak))
    return {"baseline_mib": [b for b, _ in gathered], "peak_mib": [p for _, p in gathered]}


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")  # shardspeed.initialize respects an existing default group
    succeeded = False
    try:
        rank = dist.get_rank()
        setup = make_setup(MODEL_SIZES[args.model], rank)
        rows = resolve_rows(requested_rows(args))
        if args.memory_row is not None:
            result = memory_run(args, rows, ROWS[args.memory_row], setup)
        else:
            result = timing_run(args, rows, setup)
        if rank == 0 and args.result_file:
            Path(args.result_file).write_text(json.dumps(result))
        elif rank == 0 and args.memory_row is None:
            print(format_report(result, {}))
        succeeded = True
    finally:
        # Free the rows' DDP reducers, FSDP2 states and engines (reference cycles) while the process group
        # still exists: left to interpreter exit, a DDP reducer torn down after its group sometimes aborts the
        # process ("terminate called without an active exception") even though the run itself succeeded.
        gc.collect()
        if succeeded:  # after a failure the other ranks may never reach it: a barrier would hang, not exit
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        requested = requested_rows(args)
        resolve_rows(requested)
    except ValueError as error:
        raise SystemExit(f"bench_engine: {error}") from None
    missing = [name for name in requested if name in DEEPSPEED_ROWS and not deepspeed_installed()]
    if missing:
        raise SystemExit(f"bench_engine: --rows {missing[0]} needs deepspeed, which is not installed")
    if "RANK" in os.environ:
        rank_main(args)
    else:
        launcher_main(args)


if __name__ == "__main__":
    main()
