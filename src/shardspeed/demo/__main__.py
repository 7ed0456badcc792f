"""``python -m shardspeed.demo``: train a small GPT on the Python standard library's source, data-parallel.

Run from a plain shell, it relaunches itself under ``torch.distributed.run`` with ``--nproc`` workers (so
``make demo`` needs no launcher knowledge) and exits with their verdict. Run by a launcher (``RANK`` is set),
it is one of those workers.

Outcomes a user should read as one line (a config error such as an unsupported ZeRO stage, or a loss that
did not go down) are reported through a result file rather than a failing worker exit code: a failing worker
makes torch.distributed.run print its crash report, which would bury the one line. Real crashes still fail
the worker and get that report, traceback included.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

RESULT_FILE_ENV = "SHARDSPEED_DEMO_RESULT"
# The relauncher hands the workers their arguments here, not on torch.distributed.run's command line: the
# launcher's own parser would claim some of them (``--nproc`` is an ambiguous prefix of its
# ``--nproc-per-node``, and abbreviations such as ``--st`` would match its options too).
ARGV_ENV = "SHARDSPEED_DEMO_ARGV"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shardspeed.demo",
        description="Train a small byte-level GPT on the Python stdlib's source with shardspeed "
        "(data-parallel over --nproc processes; CPU/gloo, or CUDA/NCCL when GPUs are present).",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--nproc", type=int, default=2, help="worker processes (data-parallel ranks); default 2")
    run.add_argument("--stage", type=int, default=0, help="ZeRO stage (zero_optimization.stage); default 0")
    run.add_argument("--steps", type=int, default=300, help="optimizer steps; default 300")
    run.add_argument(
        "--time-budget",
        type=float,
        default=180.0,
        help="stop early after this many seconds (0 = no limit); default 180",
    )
    run.add_argument("--bf16", action="store_true", help="train in bf16 (fp32 master weights)")
    run.add_argument("--cpu", action="store_true", help="train on CPU even when CUDA is available")
    run.add_argument("--seed", type=int, default=0, help="model initialisation seed; default 0")
    observe = parser.add_argument_group("observability")
    observe.add_argument(
        "--run-dir",
        default=None,
        help="where the run writes ds_config.json, its TensorBoard and CSV logs, the flops profile and the report; "
        "default a fresh runs/demo-<UTC timestamp>",
    )
    observe.add_argument(
        "--comms-log",
        action="store_true",
        help="enable comms_logger and print its summary (per collective, and traffic per step vs ZeRO's theory)",
    )
    observe.add_argument(
        "--wandb", action="store_true", help="also log to Weights & Biases (offline into the run dir unless WANDB_MODE)"
    )
    batch = parser.add_argument_group("batch and optimizer")
    batch.add_argument("--micro-batch", type=int, default=8, help="windows per rank per micro-step; default 8")
    batch.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps; default 1")
    batch.add_argument("--lr", type=float, default=3e-3, help="peak learning rate; default 3e-3")
    batch.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay; default 0.1")
    batch.add_argument("--warmup", type=int, default=None, help="warmup steps; default steps/10, at most 30")
    model = parser.add_argument_group("model and data")
    model.add_argument("--tiny", action="store_true", help="a tiny model for smoke tests (2 layers, d_model 64)")
    model.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4; --tiny 2)")
    model.add_argument("--d-model", type=int, default=None, help="model width (default 128; --tiny 64)")
    model.add_argument("--heads", type=int, default=None, help="attention heads (default 4; --tiny 2)")
    model.add_argument("--context", type=int, default=None, help="tokens per window (default 128; --tiny 64)")
    model.add_argument("--corpus-mb", type=float, default=4.0, help="MB of stdlib source to read; default 4")
    model.add_argument("--eval-windows", type=int, default=256, help="held-out windows for eval; default 256")
    model.add_argument("--log-every", type=int, default=10, help="steps between progress updates; default 10")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    positive = ("nproc", "steps", "micro_batch", "grad_accum", "eval_windows", "log_every")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("layers", "d_model", "heads", "context"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.corpus_mb <= 0 or args.lr <= 0 or args.time_budget < 0:
        parser.error("--corpus-mb and --lr must be positive and --time-budget non-negative")
    return args


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it), for the workers' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _package_parent() -> str:
    """The directory holding the ``shardspeed`` package, so the workers import this same copy."""
    return str(Path(__file__).resolve().parents[2])


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.nproc`` workers with torch.distributed.run; return their verdict as the exit code."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    # The workers must import this same copy of shardspeed even when it was found through the current
    # directory; appended, so an explicit PYTHONPATH still wins.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), _package_parent()) if p)
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() < args.nproc:
            print(
                f"shardspeed.demo: error: --nproc {args.nproc} but only {torch.cuda.device_count()} CUDA "
                f"device(s) are visible; pass --nproc {torch.cuda.device_count()} or --cpu",
                file=sys.stderr,
            )
            return 2
    with tempfile.TemporaryDirectory(prefix="shardspeed-demo-") as scratch:
        result_path = Path(scratch, "result.json")
        env[RESULT_FILE_ENV] = str(result_path)
        env[ARGV_ENV] = json.dumps(argv)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(args.nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "shardspeed.demo",
        ]
        launcher = subprocess.Popen(command, env=env)
        try:
            returncode = launcher.wait()
        except KeyboardInterrupt:  # the launcher got the same Ctrl-C and is stopping its workers
            launcher.wait()
            return 130
        if returncode != 0:
            return returncode  # a crash: torch.distributed.run has already reported it
        if not result_path.exists():
            print("shardspeed.demo: error: the workers exited without reporting a result", file=sys.stderr)
            return 1
        return int(json.loads(result_path.read_text())["exit_code"])


def worker(args: argparse.Namespace) -> int:
    """One rank's run. Returns the process exit code (0 under the relauncher: the verdict is in the file)."""
    import torch.distributed as dist

    from shardspeed.config.errors import ConfigError
    from shardspeed.demo.train import run

    rank = int(os.environ.get("RANK", "0"))
    try:
        exit_code = run(args)
    except ConfigError as error:  # raised identically on every rank, before any collective
        if rank == 0:
            print(f"shardspeed.demo: config error: {error}", file=sys.stderr, flush=True)
        exit_code = 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result_path = os.environ.get(RESULT_FILE_ENV)
    if result_path is None:
        return exit_code
    if rank == 0:
        Path(result_path).write_text(json.dumps({"exit_code": exit_code}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        if ARGV_ENV in os.environ:  # started by relaunch(): the arguments travel in the environment
            argv = json.loads(os.environ[ARGV_ENV])
        return worker(parse_args(argv))
    args = parse_args(argv)
    if args.run_dir is None:  # chosen once here, so every worker writes into the same fresh directory
        from shardspeed.demo.observe import default_run_dir

        args.run_dir = str(default_run_dir())
        argv = [*argv, "--run-dir", args.run_dir]
    return relaunch(args, argv)


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ:
        # A finished worker skips interpreter finalization: torch's C++ statics (thread pools, the gloo
        # transport) are occasionally torn down in an order that aborts with "terminate called without an
        # active exception" *after* all work is done and the process group destroyed, turning a successful run
        # into a crash report. Everything that matters has been flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
