"""kill -9 of a rank in the middle of ``save_checkpoint``, in real processes launched by ``shardspeed``: rank 1
SIGKILLs itself at its second chunk write (``SHARDSPEED_INJECT=checkpoint_write:kill:rank=1:after=1``). The launcher
tears the job down; ``latest`` still names the previous complete checkpoint, which a relaunched job loads; its
next save of the same tag commits and removes the killed save's ``.tmp-`` directory; and the resumed run's
parameters equal the uninterrupted run's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
import json, os, sys
import torch
import shardspeed

where, phase, out = sys.argv[-3:]  # after the --local_rank=N the launcher passes
shardspeed.init_distributed()
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
config = {
    "train_micro_batch_size_per_gpu": 2,
    # torch's per-tensor AdamW: with the default fused kernel this bitwise resume check differs by rounding
    # (~1e-7; cause not yet isolated, see the issue #16 note), so the bitwise guarantee is asserted on this kernel
    "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "fused": False}},
    "zero_optimization": {"stage": 2},
    "steps_per_print": 1000,
}
engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

def train(steps):
    for _ in range(steps):
        g = torch.Generator().manual_seed(100 * engine.global_steps + rank)
        x = torch.randn(2, 6, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()

def dump(name):
    values = {n: p.detach().tolist() for n, p in engine.module.named_parameters()}
    with open(os.path.join(out, "%s-rank%d.json" % (name, rank)), "w") as handle:
        json.dump({"steps": engine.global_steps, "params": values}, handle)

if phase == "interrupted":
    train(2)
    engine.save_checkpoint(where)  # global_step2
    train(1)
    dump("uninterrupted")  # what a run that was not killed has after step 3
    os.environ["SHARDSPEED_INJECT"] = "checkpoint_write:kill:rank=1:after=1"
    engine.save_checkpoint(where)  # global_step3: rank 1 dies in the middle of writing it
    print("rank %d: save returned" % rank, flush=True)
else:
    path, _ = engine.load_checkpoint(where)
    print("rank %d: resumed from %s at step %d" % (rank, path, engine.global_steps), flush=True)
    train(1)
    dump("resumed")
    engine.save_checkpoint(where)  # global_step3 again
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(tmp_path: Path, phase: str) -> tuple[subprocess.CompletedProcess[str], float]:
    pythonpath = os.pathsep.join(p for p in (str(REPO_SRC), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    env.pop("SHARDSPEED_INJECT", None)
    command = [sys.executable, "-m", "shardspeed.launcher.cli", "--num_procs", "2", "--master_port", str(_free_port())]
    command += ["train.py", str(tmp_path / "ckpt"), phase, str(tmp_path / "out")]
    start = time.monotonic()
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    return completed, time.monotonic() - start


@pytest.mark.slow  # two launches of two processes: ~30 s of torch start-up; tests/dist covers the commit order
@pytest.mark.timeout(360)
def test_kill_9_mid_save_keeps_latest_and_resume_matches(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    ckpt = tmp_path / "ckpt"
    killed, elapsed = _launch(tmp_path, "interrupted")
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0, output[-4000:]
    assert "save returned" not in output  # rank 0 did not get past the save either: the launcher stopped it
    assert elapsed < 120  # the launcher tore the job down (no hang in the save's collective)
    assert (ckpt / "latest").read_text() == "global_step2"
    assert not (ckpt / "global_step3").exists()
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-global_step3-")]
    assert len(leftovers) == 1  # the killed save's directory: ignored by loads

    resumed, _ = _launch(tmp_path, "resume")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "resumed from " in output and "global_step2 at step 2" in output
    assert (ckpt / "latest").read_text() == "global_step3"
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]  # the stale one is gone
    for rank in range(2):
        reference = json.loads((tmp_path / "out" / f"uninterrupted-rank{rank}.json").read_text())
        again = json.loads((tmp_path / "out" / f"resumed-rank{rank}.json").read_text())
        assert reference["steps"] == again["steps"] == 3
        assert reference["params"] == again["params"]  # bitwise: same data, same RNG, same states
