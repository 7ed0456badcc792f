"""ZeRO optimizer offload (cpu / nvme) equals the same stage without offload; NVMe swap files are per rank,
unlinked at once (nothing under nvme_path even while training), closed on destroy, checked at init on every rank;
checkpoints round-trip through the swapped state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parity import full_params, global_batches, make_model, offload_engine, train_engine

import shardspeed
from harness import deleted_files_held, error_of

STEPS, MB, GAS, CLIP = 5, 2, 2, 0.5


def _engine(stage: int, offload: dict | None, bf16: bool = False, optimizer: str = "AdamW"):
    zero: dict = {"stage": stage, "reduce_bucket_size": 100}
    if offload is not None:
        zero["offload_optimizer"] = offload
    return offload_engine(zero, bf16=bf16, clip=CLIP, optimizer=optimizer, mb=MB, gas=GAS)


def _offload_config(device: str, tmp: str) -> dict:
    return {"device": device, "nvme_path": os.path.join(tmp, "swap")} if device == "nvme" else {"device": device}


def _parity(rank: int, world: int, stage: int, device: str, tmp: str, bf16: bool) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    plain = _engine(stage, None, bf16)
    train_engine(plain, rank, world, batches, MB, GAS)
    offloaded = _engine(stage, _offload_config(device, tmp), bf16)
    swap = os.path.join(tmp, "swap")
    train_engine(offloaded, rank, world, batches, MB, GAS)
    result = {"plain": full_params(plain), "offloaded": full_params(offloaded)}
    result["named"] = sorted(os.listdir(swap)) if device == "nvme" else []
    result["held"] = sorted(deleted_files_held(swap).values()) if device == "nvme" else []
    result["state_bytes"] = (
        plain.memory_breakdown()["optimizer_states"],
        offloaded.memory_breakdown()["optimizer_states"],
    )
    offloaded.destroy()
    result["held_after_destroy"] = sorted(deleted_files_held(swap).values()) if device == "nvme" else []
    return result


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_equals_no_offload(dist_run, tmp_path: Path, stage: int, device: str) -> None:
    results = dist_run(_parity, 2, stage, device, str(tmp_path), False)
    initial = dict(make_model().named_parameters())
    for rank, r in enumerate(results):
        moved = max((r["plain"][n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3  # training really changed the parameters
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name
        plain_bytes, offloaded_bytes = r["state_bytes"]
        assert plain_bytes > 0
        assert offloaded_bytes == (0 if device == "nvme" else plain_bytes)  # nvme: no Adam moments in memory
        if device == "nvme":
            assert r["named"] == []  # after a few steps, nothing under nvme_path by name
            assert len(r["held"]) == 1 and r["held"][0].endswith(f"-rank{rank}/swap.bin (deleted)")  # this rank's
            assert r["held_after_destroy"] == []  # destroy closed it: its space is free


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_bf16_equals_no_offload(dist_run, tmp_path: Path, stage: int) -> None:
    results = dist_run(_parity, 2, stage, "nvme", str(tmp_path), True)
    for r in results:
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name


_EXIT_SCRIPT = """
import os, sys, torch, shardspeed
model = torch.nn.Linear(5, 3)
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}}
engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.backward(engine(torch.randn(2, 5)).sum())
engine.step()
held = 0
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the descriptor listdir itself used
        continue
    held += link.startswith(sys.argv[1]) and link.endswith(" (deleted)")
print(len(os.listdir(sys.argv[1])), held)
if sys.argv[2] == "raise":
    raise RuntimeError("training failed")
"""


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_swap_files_removed_at_process_exit(tmp_path: Path, ending: str) -> None:
    """No destroy(): the swap file (unlinked from the start) is closed when the process ends, normally or by an
    exception, and nothing is left under nvme_path. (A separate process: the dist harness leaves its ranks with
    os._exit, which skips exit handlers.)"""
    import subprocess
    import sys

    swap = tmp_path / "swap"
    src = Path(shardspeed.__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(swap), ending], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == (0 if ending == "return" else 1), done.stderr
    assert done.stdout.split() == ["0", "1"]  # while training: no name under nvme_path, one open swap file
    assert os.listdir(swap) == []


def _bad_path(rank: int, world: int, tmp: str) -> str:
    blocker = Path(tmp) / "not-a-dir"
    blocker.touch()
    path = str(blocker / "swap") if rank == 1 else os.path.join(tmp, "swap")  # only rank 1's path is unusable
    return error_of(lambda: _engine(1, {"device": "nvme", "nvme_path": path}))


def test_unusable_nvme_path_fails_every_rank_at_init(dist_run, tmp_path: Path) -> None:
    messages = dist_run(_bad_path, 2, str(tmp_path))
    for message in messages:
        assert message.startswith("SwapSetupError"), message
        assert "nvme_path" in message and "rank 1" in message and "not-a-dir" in message
    assert os.listdir(tmp_path / "swap") == []  # rank 0's directory was removed again


def _sgd(rank: int, world: int, tmp: str) -> str:
    return error_of(lambda: _engine(1, _offload_config("nvme", tmp), optimizer="SGD"))


def test_non_adam_optimizer_is_a_clear_error(dist_run, tmp_path: Path) -> None:
    for message in dist_run(_sgd, 2, str(tmp_path)):
        assert "ConfigError" in message and "Adam or AdamW" in message and "SGD" in message


def _resume(rank: int, world: int, stage: int, tmp: str) -> dict:
    batches = global_batches(STEPS, MB * GAS * world)
    offload = _offload_config("nvme", tmp)
    first = _engine(stage, offload)
    train_engine(first, rank, world, batches[:3], MB, GAS)
    first.save_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(first, rank, world, batches[3:], MB, GAS)
    continued = full_params(first)
    first.destroy()
    resumed = _engine(stage, offload)
    resumed.load_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(resumed, rank, world, batches[3:], MB, GAS)
    plain = _engine(stage, None)  # the same checkpoint loads into an engine without offload
    plain.load_checkpoint(os.path.join(tmp, "ckpt"))
    train_engine(plain, rank, world, batches[3:], MB, GAS)
    return {"continued": continued, "resumed": full_params(resumed), "plain": full_params(plain)}


@pytest.mark.parametrize("stage", [1, 3])
def test_nvme_checkpoint_round_trip(dist_run, tmp_path: Path, stage: int) -> None:
    for r in dist_run(_resume, 2, stage, str(tmp_path)):
        for name, p in r["continued"].items():
            assert (r["resumed"][name] - p).abs().max().item() <= 1e-6, name
            assert (r["plain"][name] - p).abs().max().item() <= 1e-6, name


def _save_after_three(rank: int, world: int, tmp: str) -> None:
    engine = _engine(2, _offload_config("nvme", tmp))
    train_engine(engine, rank, world, global_batches(3, MB * GAS * world), MB, GAS)
    engine.save_checkpoint(os.path.join(tmp, "ckpt"))
    engine.destroy()


def _load_and_train(rank: int, world: int, tmp: str) -> dict:
    batches = global_batches(2, MB * GAS * world, seed=9)
    out = {}
    for label, offload in (("nvme", _offload_config("nvme", tmp)), ("plain", None)):
        engine = _engine(3, offload)
        engine.load_checkpoint(os.path.join(tmp, "ckpt"))
        train_engine(engine, rank, world, batches, MB, GAS)
        out[label] = full_params(engine)
        engine.destroy()
    return out


def test_nvme_checkpoint_reshards_across_stage_and_world(dist_run, tmp_path: Path) -> None:
    """Saved by stage 2 at world 2, loaded by stage 3 at world 1: the swapped-in moments continue exactly as the
    same checkpoint loaded without offload (Adam's first steps depend strongly on the moments)."""
    dist_run(_save_after_three, 2, str(tmp_path))
    (result,) = dist_run(_load_and_train, 1, str(tmp_path))
    for name, p in result["plain"].items():
        assert (result["nvme"][name] - p).abs().max().item() <= 1e-6, name
