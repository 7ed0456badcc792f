"""Clean exit: how many consecutive 2-process training runs exit 0.

    python benchmarks/bench_clean_exit.py [--runs 100] [--nproc 2] [--baseline]

Each run is ``shardspeed --num_procs 2 train.py`` on a minimal script (``shardspeed.initialize`` on a tiny
Linear, two SGD steps). Before shardspeed destroyed its process group at exit, about 6% of such runs ended with
SIGABRT ("terminate called without an active exception", gloo's teardown after Python had finalized) although
the script had finished. ``--baseline`` reproduces that state in the same script: it unregisters shardspeed's
exit hook, so a run with and without the fix can be compared on one machine.

Prints one line per run to stderr (its exit code; for a failure the tail of its stderr) and a JSON summary: runs,
exit-0 count, failures by exit code, runs whose stderr contains gloo's "terminate called" message, wall time.
A run takes a few seconds (three Python processes import torch); 100 runs take several minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_util import child_env, free_port

ABORT_SIGNATURE = "terminate called"
# The rendezvous port is picked free just before the launch; on a busy machine another process can take it in
# between. That is a property of the harness, not of the exit: such a launch is retried on a fresh port.
PORT_TAKEN_SIGNATURE = "EADDRINUSE"
PORT_RETRIES = 3

TRAIN_SCRIPT = """
import argparse, atexit
import torch
import shardspeed as deepspeed
import shardspeed.distributed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--baseline", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
if args.baseline:  # the state before the fix: no process-group teardown at exit
    atexit.unregister(shardspeed.distributed._destroy_created_group_at_exit)
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, _, _, _ = deepspeed.initialize(args=args, model=model, config=config)
for _ in range(2):
    loss = engine(torch.randn(4, 8)).square().mean()
    engine.backward(loss)
    engine.step()
"""


def run_once(directory: Path, nproc: int, baseline: bool) -> tuple[int, str, int]:
    """One run; returns (exit code, stderr, launches retried because the rendezvous port was taken)."""
    for retry in range(PORT_RETRIES + 1):
        returncode, stderr = launch(directory, nproc, baseline)
        if not (returncode != 0 and PORT_TAKEN_SIGNATURE in stderr) or retry == PORT_RETRIES:
            return returncode, stderr, retry
    raise AssertionError("unreachable")


def launch(directory: Path, nproc: int, baseline: bool) -> tuple[int, str]:
    """One launch; returns (exit code, stderr)."""
    command = [sys.executable, "-m", "shardspeed.launcher.cli", "--num_procs", str(nproc)]
    command += ["--master_port", str(free_port()), "train.py", *(["--baseline"] if baseline else [])]
    env = child_env(cpu_only=False, force_one_thread=True)
    completed = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=300)
    return completed.returncode, completed.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--baseline", action="store_true", help="unregister shardspeed's exit hook (before the fix)")
    parser.add_argument("--keep-failures", metavar="DIR", help="write each failing run's full stderr to DIR/run<N>.txt")
    args = parser.parse_args()
    exit_codes: collections.Counter[int] = collections.Counter()
    aborts = port_retries = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-clean-exit-") as scratch:
        Path(scratch, "train.py").write_text(TRAIN_SCRIPT)
        for index in range(args.runs):
            returncode, stderr, retried = run_once(Path(scratch), args.nproc, args.baseline)
            port_retries += retried
            exit_codes[returncode] += 1
            aborts += ABORT_SIGNATURE in stderr
            tail = " | ".join(stderr.strip().splitlines()[-3:]) if returncode != 0 else ""
            if returncode != 0 and args.keep_failures:
                Path(args.keep_failures).mkdir(parents=True, exist_ok=True)
                Path(args.keep_failures, f"run{index + 1}.txt").write_text(stderr)
            print(f"run {index + 1}/{args.runs}: exit code {returncode} {tail}".rstrip(), file=sys.stderr, flush=True)
    summary = {
        "runs": args.runs,
        "nproc": args.nproc,
        "baseline": args.baseline,
        "exit_0": exit_codes[0],
        "failures_by_exit_code": {str(code): count for code, count in sorted(exit_codes.items()) if code != 0},
        "runs_with_terminate_called": aborts,
        "launches_retried_port_taken": port_retries,
        "wall_s": round(time.monotonic() - start, 1),
    }
    print(json.dumps(summary))
    return 0 if exit_codes[0] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
