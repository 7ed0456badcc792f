"""Elastic restart and preemption end to end (issue #13's "Must show"), under ``python -m torch.distributed.run``.

- Elastic: a 2-rank run saving every 2 steps; on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 kills
  itself with SIGKILL in the middle of step 5 (after its boundary backward, before ``step()``); torchrun
  (``--max-restarts 1``) restarts both ranks, ``fault_tolerance.auto_resume`` loads step 4, and the run ends with
  parameters equal (≤ 1e-6) to an uninterrupted one.
- Preemption: SIGTERM to torchrun, which forwards it to the workers; both ranks stop at the next step boundary, save
  and exit with status 75 and one line each; a relaunch with auto_resume reproduces the uninterrupted run.

The uninterrupted reference is trained by the same worker processes after the resumed run: a fresh engine from
the same seed and no checkpoint directory (each launch costs seconds of imports on a loaded machine; one is enough).
Dropout is on and the data loader shuffles (the engine's, ``training_data=``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r"""
import argparse, json, os, signal, sys, time
import torch
import torch.nn.functional as F
import shardspeed

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--total", type=int, default=8)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--kill-at", type=int, default=0)
parser.add_argument("--ready-at", type=int, default=0)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--no-reference", action="store_true")
args = parser.parse_args()
GAS = 2

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))

def dataset():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 6, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(6, 3, generator=g)))

def build(fault_tolerance):
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
        "fault_tolerance": fault_tolerance,
    }
    engine, _, loader, _ = shardspeed.initialize(model=model, training_data=dataset(), config=config)
    return engine, iter(shardspeed.RepeatingLoader(loader))

rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
joining = os.path.join(args.out, "rank1-joins-attempt1")
if attempt == 1 and rank == 1:
    open(joining, "w").close()
if attempt == 1 and rank == 0:  # rank 1 joins first: it must not read rank 0's address from the attempt that died
    deadline = time.monotonic() + 60
    while not os.path.exists(joining) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
engine, batches = build({"checkpoint_dir": args.ckpt, "auto_resume": True, "save_on_preemption": True})
start = engine.global_steps
print(f"rank {rank} attempt {attempt} starts at step {start}", flush=True)
while engine.global_steps < args.total:
    x, y = next(batches)
    engine.backward(F.mse_loss(engine(x), y))
    dying = attempt == 0 and rank == 1 and engine.global_steps + 1 == args.kill_at
    if dying and engine.is_gradient_accumulation_boundary():
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: this step's gradients reduced, the optimizer not run
    engine.step()
    if engine.micro_steps % GAS == 0:  # an optimizer step finished
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt)
        if rank == 0 and engine.global_steps == args.ready_at:  # the test may send its signal now
            open(os.path.join(args.out, "ready"), "w").close()
        time.sleep(args.sleep)
resumed = {k: v.clone() for k, v in engine.module_state_dict().items()}
engine.destroy()
if args.no_reference:
    sys.exit(0)

engine, batches = build({})  # the uninterrupted reference: same seed, nothing to resume
while engine.global_steps < args.total:
    x, y = next(batches)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
reference = engine.module_state_dict()
diff = max((reference[k] - resumed[k]).abs().max().item() for k in reference)
if rank == 0:
    with open(os.path.join(args.out, "result.json"), "w") as handle:
        json.dump({"max_abs_diff": diff, "start_step": start, "attempt": attempt}, handle)
"""


def _launch(tmp_path: Path, name: str, max_restarts: int | None, *script_args: str) -> subprocess.Popen:
    """torchrun with 2 workers and ``max_restarts``; ``None``: the script alone, a world of one."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_SRC), "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20"}
    cmd = [sys.executable]
    if max_restarts is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.2"]
    cmd += [str(script), "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), *script_args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout}s:\n{output[-4000:]}")
    return output


def _elastic(tmp_path: Path, stage: int) -> None:
    proc = _launch(tmp_path, "run", 1, "--stage", str(stage), "--total", "8", "--save-every", "2", "--kill-at", "5")
    output = _finish(proc, 240)
    assert proc.returncode == 0, output[-4000:]
    assert "rank 1 attempt 0 starts at step 0" in output
    assert "rank 1 attempt 1 starts at step 4" in output  # restarted automatically from the last save
    assert "auto_resume: resumed from" in output
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["attempt"] == 1 and result["start_step"] == 4
    assert result["max_abs_diff"] <= 1e-6, result
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step8"


@pytest.mark.timeout(600)  # three worker launches: tens of seconds on a loaded 2-core machine
def test_elastic_restart_after_sigkill_reproduces_uninterrupted_run_zero2(tmp_path: Path) -> None:
    _elastic(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_restart_after_sigkill_reproduces_uninterrupted_run_zero3(tmp_path: Path) -> None:
    _elastic(tmp_path, 3)


def _signal_when_ready(tmp_path: Path, proc: subprocess.Popen) -> tuple[str, float]:
    """SIGTERM to ``proc`` once rank 0 finished step 2; its output and the seconds it took to exit after that."""
    ready = tmp_path / "first" / "ready"
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), _finish(proc, 5)[-4000:]
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output = _finish(proc, 90)
    return output, time.monotonic() - sent


@pytest.mark.slow  # make test keeps the dist preemption test (tests/dist/test_preemption.py) for this fault kind
@pytest.mark.timeout(300)
def test_sigterm_to_a_script_exits_75_with_one_line(tmp_path: Path) -> None:
    """An unmodified script (a world of one, no launcher): SIGTERM → stop after the step, save, status 75, the
    message and no traceback."""
    args = ("--total", "60", "--ready-at", "2", "--sleep", "0.3", "--no-reference")
    proc = _launch(tmp_path, "first", None, *args)
    output, took = _signal_when_ready(tmp_path, proc)
    assert proc.returncode == 75, output[-4000:]
    step = int(re.search(r"preempted by SIGTERM at step (\d+); checkpoint saved to ", output).group(1))
    assert "Traceback" not in output
    assert took < 60
    print(f"SIGTERM to a lone script: stopped after step {step}, status 75, {took:.1f} s after the signal")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{step}"


def _preempt_then_resume(tmp_path: Path, stage: int) -> None:
    proc = _launch(tmp_path, "first", 0, "--stage", str(stage), "--total", "60", "--ready-at", "2", "--sleep", "0.3")
    output, took = _signal_when_ready(tmp_path, proc)  # to torchrun only: it forwards SIGTERM to its workers
    assert proc.returncode != 0
    stops = re.findall(r"\[shardspeed rank(\d)\] rank \d: preempted by SIGTERM at step (\d+); checkpoint saved", output)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], output[-4000:]
    steps = {int(step) for _, step in stops}
    assert len(steps) == 1, stops  # every rank stopped at the same boundary
    step = steps.pop()
    assert 2 <= step < 60
    assert "raise Preempted" not in output  # workers end quietly (torchrun prints its own SignalException)
    assert took < 60
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{step}"
    print(f"SIGTERM to torchrun: both ranks stopped after step {step}, exited {took:.1f} s after the signal")

    proc = _launch(tmp_path, "second", 0, "--stage", str(stage), "--total", str(step + 3))
    output = _finish(proc, 180)
    assert proc.returncode == 0, output[-4000:]
    result = json.loads((tmp_path / "second" / "result.json").read_text())
    assert result["start_step"] == step
    assert result["max_abs_diff"] <= 1e-6, result


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_torchrun_stops_saves_and_resumes_exactly(tmp_path: Path) -> None:
    _preempt_then_resume(tmp_path, 3)
