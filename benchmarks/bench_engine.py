"""Side-by-side training speed, exposed communication and memory: shardspeed against torch peers and DeepSpeed.

    python benchmarks/bench_engine.py [--model mlp|small|medium|all] [--nproc 2] [--rounds 7] [--steps 10]
                                      [--warmup 3] [--rows stage0,ddp,...] [--device cpu|cuda]
                                      [--deepspeed-python PATH] [--skip-memory] [--json FILE]

Models: ``mlp`` is issue #16's comm-bound MLP (6 x Linear(1024, 1024), 6.3M parameters, batch 32, MSE), ``small``
/ ``medium`` the demo GPT; ``all`` runs ``mlp`` then ``small``, each as its own set of runs and tables.

Rows (bench_rows.py): shardspeed ZeRO stages 0-3 against their torch peers (stage 0 and 2 vs DDP, stage 1 vs
ZeroRedundancyOptimizer, stage 3 vs FSDP2), with issue #16's target next to each ratio; "before" rows
(``stage<N>_before``: ``overlap_param_gather: false``, ``communication.collectives: "native"``) in the same
rounds; DeepSpeed 0.19.x rows when ``--deepspeed-python`` (or ``$SHARDSPEED_DEEPSPEED_PYTHON``) names a python
that imports deepspeed, or deepspeed imports here.

Run plainly, this script is the launcher: it starts itself under ``torch.distributed.run`` (gloo on CPU, one
thread per rank; NCCL and one rank per GPU with ``--device cuda``) once for the timing run and once per row for
the memory runs, then prints the tables.

Timing: every row is built in one set of processes, then timed in rounds. Each round times ``--steps`` steps
of every row back to back, in an order that reverses from round to round so slow drift of the machine does not
favour the row that always runs first, and that puts each peer amid the rows compared with it (``timing_order``)
so a row and its peer run close together in time. The per-round ratio row/peer (both from the same round: paired) is
summarised by its median and IQR (``stats.py``).

Exposed communication (shardspeed rows): the engine's ``collectives.blocked`` is reset before each timed block
and read after it (bench_exposed.py): ms per step blocked in waits, by op and by group (grads / params / other).

DeepSpeed runs in its own venv (it pins its own requirements; ``bench_pipe.py``'s docstring has the install
command), so its rows run in a second set of processes started with that python, together with the same torch
peers, timed in their own interleaved rounds: each DeepSpeed ratio is paired within its process set. Across the
two sets nothing is paired: the report compares DeepSpeed with shardspeed only through the common peer
(``(deepspeedN/peer) / (stageN/peer)``, medians of each set), an indicative figure. DeepSpeed builds AdamW from
the config as its own fused Adam op (on CPU JIT-compiled once into ``~/.cache/torch_extensions``: the first run on
a fresh machine spends minutes compiling). Its updates differ from ``torch.optim.AdamW``'s by about 5e-4 relative
(measured: 50 steps on a random tensor), so on the MLP, which memorizes its batch down to a loss near 1e-3, its
final loss can differ from the peers' beyond the 1e-4 agreement tolerance although its first steps agree to 1e-7.

Memory: VmHWM, the kernel's per-process peak RSS, cannot be split between rows that share a process, so each
row's peak comes from a fresh torchrun that builds only that row (on CUDA: ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import gc
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
from bench_exposed import per_step_ms
from bench_report import BEFORE_SUFFIX, format_cross_set, format_report
from bench_rows import (
    DEEPSPEED_ROWS,
    MODEL_SIZES,
    PEER_ADAM_ENV,
    ROWS,
    BenchSetup,
    Row,
    RowRun,
    deepspeed_installed,
    default_rows,
    make_setup,
    resolve_rows,
    timing_order,
)
from launch_util import child_env, free_port
from proc_status import read_status_mib

BENCH_DIR = Path(__file__).resolve().parent
ALL_MODELS = ("mlp", "small")  # what --model all runs: the comm-bound MLP, then the demo GPT


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2; cuda: at most the GPUs)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per row (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row per round (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row after building it (default 3)")
    parser.add_argument(
        "--model",
        choices=[*sorted(MODEL_SIZES), "all"],
        default="small",
        help=f"model (default small; all = {' then '.join(ALL_MODELS)})",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows; peers are added as needed (valid: {', '.join(ROWS)}; default: every row "
        f"but the DeepSpeed ones (mlp: without stage3_nopersist*), plus {','.join(DEEPSPEED_ROWS)} when "
        "deepspeed is available)",
    )
    parser.add_argument(
        "--deepspeed-python",
        default=os.environ.get("SHARDSPEED_DEEPSPEED_PYTHON"),
        help="python of a venv with deepspeed 0.19.x: its rows run in processes of that python "
        "(default $SHARDSPEED_DEEPSPEED_PYTHON)",
    )
    parser.add_argument(
        "--peer-adam",
        choices=("default", "fused"),
        default="default",
        help="the torch peers' AdamW kernel: default (torch.optim.AdamW(params), the per-tensor loop on CPU) or "
        "fused (fused=True, the kernel shardspeed's config-built AdamW runs: compares the systems alone)",
    )
    parser.add_argument("--skip-memory", action="store_true", help="no per-row memory runs (timing only)")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
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


def requested_rows(args: argparse.Namespace, model: str, deepspeed_available: bool) -> list[str]:
    if args.rows is not None:
        return [name.strip() for name in args.rows.split(",") if name.strip()]
    return [*default_rows(model), *(DEEPSPEED_ROWS if deepspeed_available else ())]


def plan_world(nproc: int, device: str, gpu_count: int) -> tuple[int, str]:
    """(ranks to start, a line saying why) for ``--nproc`` on ``device``.

    CUDA runs one rank per GPU: NCCL refuses two ranks on one device, so ``--nproc`` is capped at the GPU count
    (one GPU: world-1 rows, which time the engines without any communication). CPU runs what was asked.
    """
    if device == "cpu":
        return nproc, f"world {nproc} (gloo, CPU)"
    if gpu_count < 1:
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.device_count() == 0)")
    if nproc <= gpu_count:
        return nproc, f"world {nproc} (NCCL, one rank per GPU)"
    return gpu_count, (
        f"world {gpu_count} (NCCL, one rank per GPU): --nproc {nproc} capped at the {gpu_count} visible GPU(s)"
        + ("; world-1 rows time each engine without communication" if gpu_count == 1 else "")
    )


def split_rows(rows: list[str], deepspeed_python: str | None) -> tuple[list[str], list[str]]:
    """(rows for this python, rows for the DeepSpeed python). With a DeepSpeed python, its rows run there (and
    their peers come along there by ``resolve_rows``); without one, every row runs here."""
    if deepspeed_python is None:
        return rows, []
    return [name for name in rows if name not in DEEPSPEED_ROWS], [name for name in rows if name in DEEPSPEED_ROWS]


# --- launcher (no RANK in the environment) ---------------------------------------------------------------
def _torchrun(
    args: argparse.Namespace,
    model: str,
    rows: list[str],
    result_file: Path,
    memory_row: str | None,
    *,
    python: str = sys.executable,
    what: str = "timing run",
) -> dict[str, Any] | None:
    """Run one torchrun child; its result, or None when it failed (its output says why)."""
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        *("--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--model", model, "--rows", ",".join(rows), "--result-file", str(result_file)),
        *("--device", args.device),
        *(("--memory-row", memory_row) if memory_row else ()),
    ]
    env = child_env(paths=[BENCH_DIR], cpu_only=args.device == "cpu")
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's own accelerator choice, for the DeepSpeed processes
    if python != sys.executable:  # DeepSpeed 0.19 calls torch's deprecated collectives: one warning per call site
        env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    completed = subprocess.run(command, env=env, check=False)
    if completed.returncode != 0:
        what = f"memory run for row {memory_row!r}" if memory_row else what
        print(f"bench_engine: the {what} failed (exit code {completed.returncode}); see its output above")
        return None
    return json.loads(result_file.read_text())


def _load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:  # not Linux
        return "n/a"


def deepspeed_python(path: str | None) -> str | None:
    """``path`` when it is a python that imports deepspeed, else None (said once on stdout)."""
    if not path:
        return None
    if not Path(path).exists():
        print(f"bench_engine: --deepspeed-python {path} does not exist; DeepSpeed rows skipped")
        return None
    env = child_env(DS_ACCELERATOR="cpu")
    probe = subprocess.run([path, "-c", "import deepspeed"], env=env, capture_output=True, check=False, text=True)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        print(f"bench_engine: {path} cannot import deepspeed ({tail}); DeepSpeed rows skipped")
        return None
    return path


def _memory_runs(
    args: argparse.Namespace, model: str, rows: list[str], names: list[str], scratch: Path, python: str
) -> dict[str, dict[str, Any] | None]:
    memory: dict[str, dict[str, Any] | None] = {}
    if args.skip_memory:
        return memory
    for name in names:  # rows that failed to build in the timing run are not measured again
        # A failed memory run costs that row's memory cell, not the timings already taken.
        memory[name] = _torchrun(args, model, rows, scratch / f"memory_{name}.json", name, python=python)
    return memory


def run_model(args: argparse.Namespace, model: str, ds_python: str | None, world_note: str) -> dict[str, Any]:
    """Timing and memory runs of one model (and its DeepSpeed set); prints its tables; returns the raw results."""
    deepspeed_here = ds_python is None and deepspeed_installed()
    rows = requested_rows(args, model, deepspeed_available=ds_python is not None or deepspeed_here)
    local, remote = split_rows(rows, ds_python)
    local = [row.name for row in resolve_rows(local)] if local else []
    out: dict[str, Any] = {"model": model, "timing": None, "memory": {}, "deepspeed": None}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as scratch_dir:
        scratch = Path(scratch_dir)
        if local:
            out["timing"] = _torchrun(args, model, local, scratch / "timing.json", None)
            if out["timing"] is None:
                raise SystemExit(1)
            # Memory is not what the before rows are about (same buffers, other timing): their runs are skipped.
            measured = [name for name in out["timing"]["step_ms"] if not name.endswith(BEFORE_SUFFIX)]
            out["memory"] = _memory_runs(args, model, local, measured, scratch, sys.executable)
        if remote and ds_python is not None:
            remote = [row.name for row in resolve_rows(remote)]
            ds_timing = _torchrun(
                args, model, remote, scratch / "ds_timing.json", None, python=ds_python, what="DeepSpeed timing run"
            )
            if ds_timing is not None:
                measured = [name for name in ds_timing["step_ms"] if name in DEEPSPEED_ROWS]
                ds_memory = _memory_runs(args, model, remote, measured, scratch, ds_python)
                out["deepspeed"] = {"timing": ds_timing, "memory": ds_memory, "python": ds_python}
    timing = out["timing"] or (out["deepspeed"] or {}).get("timing")
    print()
    if timing is not None:
        print(
            f"bench_engine: {timing['model']} ({timing['parameters']:,} parameters), fp32, AdamW, "
            f"{world_note}, {timing['threads']} thread(s) per rank, micro batch {timing['micro_batch']}, "
            f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}, "
            f"torch peers' AdamW kernel {args.peer_adam}"
        )
    if out["timing"] is not None:
        print()
        print(format_report(out["timing"], out["memory"]))
    if out["deepspeed"] is not None:
        ds = out["deepspeed"]["timing"]
        print(
            f"\n--- DeepSpeed {ds.get('deepspeed_version', '?')} rows: a second set of processes "
            f"({out['deepspeed']['python']}), timed in their own interleaved rounds against the same torch peers ---"
        )
        print(format_report(ds, out["deepspeed"]["memory"], notes=out["timing"] is None))
        if out["timing"] is not None:
            print()
            print(format_cross_set(out["timing"], ds))
    elif not any(name in DEEPSPEED_ROWS for name in rows):
        print("\ndeepspeed: not available (pass --deepspeed-python PATH to a venv's python with deepspeed 0.19.x)")
    return out


def launcher_main(args: argparse.Namespace) -> None:
    gpu_count = torch.cuda.device_count() if args.device == "cuda" else 0
    try:
        args.nproc, world_note = plan_world(args.nproc, args.device, gpu_count)
    except ValueError as error:
        raise SystemExit(f"bench_engine: {error}") from None
    print(f"bench_engine: {world_note}; torch peers' AdamW kernel: {args.peer_adam}")
    os.environ[PEER_ADAM_ENV] = args.peer_adam  # every rank (and DeepSpeed's set) builds its peers from it
    ds_python = deepspeed_python(args.deepspeed_python)
    started, load_before = time.perf_counter(), _load_average()
    results = [run_model(args, model, ds_python, world_note) for model in models_of(args.model)]
    print(
        f"\n(total wall time {time.perf_counter() - started:.0f} s; 1-minute load average {load_before} before, "
        f"{_load_average()} after, on {os.cpu_count()} CPUs: a load above the rank count means other processes "
        "competed for the cores)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "world": world_note, "models": results}, indent=1))


def models_of(choice: str) -> list[str]:
    return list(ALL_MODELS) if choice == "all" else [choice]


# --- ranks (under torchrun) ------------------------------------------------------------------------------
def _all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build_row(row: Row, setup: BenchSetup) -> tuple[RowRun | None, str | None]:
    """(run, None), or (None, reason) when an optional row could not be built on every rank."""
    if not row.optional:
        return row.build(setup), None
    run, reason = None, None
    try:
        run = row.build(setup)
    except Exception as error:  # an optional row (DeepSpeed) must not take the whole benchmark down
        reason = f"{type(error).__name__}: {error}"
    if not _all_ranks_ok(run is not None):
        return None, reason or "failed to build on another rank"
    return run, None


def _synchronize(setup: BenchSetup) -> None:
    """Wait for the GPU's queue, so a timed block holds its kernels (nothing to do on CPU)."""
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)


def _slowest(value: float, setup: BenchSetup) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=setup.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def time_block(run: RowRun, steps: int, setup: BenchSetup) -> tuple[float, float, dict[str, float] | None]:
    """(mean ms per step on the slowest rank, last loss, exposed ms per step by op:tag or None) for ``steps``
    steps between two barriers. The blocked meter is reset after the first barrier and read before the second,
    so it holds exactly this block's steps (bench_exposed.py)."""
    _synchronize(setup)
    dist.barrier()
    if run.blocked is not None:
        run.blocked.reset()
    started = time.perf_counter()
    loss = torch.zeros(())
    for _ in range(steps):
        loss = run.step()
    _synchronize(setup)
    elapsed = time.perf_counter() - started
    blocked = dict(run.blocked.seconds) if run.blocked is not None else None
    dist.barrier()
    ms = _slowest(elapsed, setup) * 1000.0 / steps
    if blocked is None:
        return ms, float(loss), None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, blocked)
    return ms, float(loss), per_step_ms(gathered, steps)


def timing_run(args: argparse.Namespace, rows: list[Row], setup: BenchSetup) -> dict[str, Any]:
    rank = dist.get_rank()
    runs: dict[str, RowRun] = {}
    skipped: dict[str, str] = {}
    for row in timing_order(rows):
        run, reason = build_row(row, setup)
        if run is None:
            skipped[row.name] = reason or "failed to build"
            continue
        for _ in range(args.warmup):
            run.step()
        runs[row.name] = run
    names = list(runs)
    step_ms: dict[str, list[float]] = {name: [] for name in names}
    blocked_ms: dict[str, list[dict[str, float]]] = {}
    final_loss: dict[str, float] = {}
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            ms, final_loss[name], exposed = time_block(runs[name], args.steps, setup)
            step_ms[name].append(ms)
            if exposed is not None:
                blocked_ms.setdefault(name, []).append(exposed)
        if rank == 0:
            progress = ", ".join(f"{name} {step_ms[name][-1]:.1f} ms" for name in order)
            print(f"round {round_index + 1}/{args.rounds} ({' then '.join(order)}): {progress}", flush=True)
    kept = [row for row in rows if row.name in runs]  # reported in the requested order, timed in timing_order
    result: dict[str, Any] = {
        "rows": [{"name": r.name, "description": r.description, "peer": r.peer, "target": r.target} for r in kept],
        "step_ms": step_ms,
        "blocked_ms": blocked_ms,
        "final_loss": final_loss,
        "skipped": skipped,
        "model": setup.model_description,
        "parameters": sum(p.numel() for p in setup.template.parameters()),
        "micro_batch": setup.micro_batch,
        "world": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "device": setup.device.type,
    }
    if any(row.name in DEEPSPEED_ROWS for row in kept):
        import deepspeed

        result["deepspeed_version"] = deepspeed.__version__
    return result


def _trigger_torch_one_time_setup() -> None:
    """Pay torch's lazy one-time costs (the optimizer's first-use imports, the autograd engine's threads).

    They come to tens of MiB and every row pays them alike; paying them before the baseline keeps them out of
    each row's growth, which is then about the row's own tensors and buffers.
    """
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight])
    (weight * 2.0).sum().backward()
    optimizer.step()


def _memory_mib(setup: BenchSetup, peak: bool) -> float:
    """Host: VmHWM (peak RSS so far). CUDA: the allocator's peak (``peak``) or current allocation."""
    if setup.device.type == "cuda":
        counted = torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated
        return counted(setup.device) / 2**20
    return read_status_mib("VmHWM")


def memory_run(args: argparse.Namespace, rows: list[Row], row: Row, setup: BenchSetup) -> dict[str, Any]:
    """Peak memory per rank before and after building ``row`` and running warmup + steps steps with it."""
    for each in rows:  # the same modules in every row's process: imports cost every row the same
        each.preload()
    _trigger_torch_one_time_setup()
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    baseline = _memory_mib(setup, peak=False)
    run, reason = build_row(row, setup)
    if run is None:
        raise RuntimeError(f"row {row.name!r} failed to build in its memory run: {reason}")
    for _ in range(args.warmup + args.steps):
        run.step()
    _synchronize(setup)
    peak = _memory_mib(setup, peak=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (baseline, peak))
    return {"baseline_mib": [b for b, _ in gathered], "peak_mib": [p for _, p in gathered], "device": setup.device.type}


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")  # initialize() keeps an existing group
    succeeded = False
    try:
        rank = dist.get_rank()
        setup = make_setup(MODEL_SIZES[args.model], rank, device)
        rows = resolve_rows(requested_rows(args, args.model, deepspeed_installed()))
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
    if "RANK" in os.environ:
        if args.model == "all":
            raise SystemExit("bench_engine: a rank runs one model; --model all is for the launcher")
        rank_main(args)
        return
    try:
        resolve_rows(requested_rows(args, "small", deepspeed_available=False))
    except ValueError as error:
        raise SystemExit(f"bench_engine: {error}") from None
    ds_asked = args.rows is not None and any(name in DEEPSPEED_ROWS for name in requested_rows(args, "small", False))
    if ds_asked and not args.deepspeed_python and not deepspeed_installed():
        raise SystemExit(
            "bench_engine: the DeepSpeed rows need deepspeed: pass --deepspeed-python PATH (a venv's python "
            "with deepspeed 0.19.x) or install it here"
        )
    launcher_main(args)


if __name__ == "__main__":
    main()
