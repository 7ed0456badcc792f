"""ENOSPC during NVMe optimizer offload, world 2: at setup (the swap file's preallocation; injected on one rank, and
a real full tmpfs where mounting is permitted) and mid-run (a swap write in step 2 on one rank). Every rank raises
one clear error naming the failing rank, the swap file and the OSError, within a generous bound; nothing stays
under nvme_path and no descriptor of a swap file stays open once the engine is destroyed."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from disk_full import fill, small_tmpfs  # noqa: F401 (a fixture)
from parity import global_batches, offload_engine, train_engine

from harness import deleted_files_held, error_of
from shardspeed.faults.inject import ENV_VAR

MB, GAS = 2, 2
BOUND_S = 30.0  # generous: the agreed error takes well under a second even on a loaded machine
KEY = "zero_optimization.offload_optimizer.nvme_path"


def _nvme_engine(swap: str) -> Any:
    return offload_engine({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}, mb=MB, gas=GAS)


def _setup_fails(rank: int, world: int, swap: str, inject: str | None) -> dict[str, Any]:
    if inject is not None:
        os.environ[ENV_VAR] = inject
    elif rank == 0:  # a real full disk: nothing left for the swap files
        os.makedirs(swap, exist_ok=True)
        fill(Path(swap) / "filler")
    dist.barrier()
    start = time.monotonic()
    error = error_of(lambda: _nvme_engine(swap))
    elapsed = time.monotonic() - start
    os.environ.pop(ENV_VAR, None)
    dist.barrier()
    return {"error": error, "elapsed": elapsed, "named": sorted(os.listdir(swap)), "held": deleted_files_held(swap)}


def test_enospc_at_swap_setup_fails_every_rank(dist_run, tmp_path: Path) -> None:
    swap = str(tmp_path / "swap")
    for r in dist_run(_setup_fails, 2, swap, "offload_setup:enospc:rank=1"):
        assert r["error"].startswith(f"SwapSetupError: {KEY} = {swap!r} is unusable on data-parallel rank 1: "), r
        assert f"cannot preallocate the swap file {swap}/" in r["error"] and "-rank1/swap.bin" in r["error"], r
        assert "No space left on device (injected by SHARDSPEED_INJECT='offload_setup:enospc:rank=1')" in r["error"]
        assert r["elapsed"] < BOUND_S
        assert r["named"] == [] and r["held"] == {}  # no swap directory, file or open descriptor left


@pytest.mark.slow  # the injected case above is the default suite's setup fault
def test_real_full_disk_at_swap_setup_fails_every_rank(dist_run, small_tmpfs: Path) -> None:  # noqa: F811
    swap = str(small_tmpfs / "swap")
    for r in dist_run(_setup_fails, 2, swap, None):
        assert "is unusable on data-parallel rank " in r["error"] and "cannot preallocate the swap file" in r["error"]
        assert "No space left on device" in r["error"], r
        assert r["elapsed"] < BOUND_S
        assert r["named"] == ["filler"] and r["held"] == {}


def _step_fails(rank: int, world: int, swap: str) -> dict[str, Any]:
    batches = global_batches(2, MB * GAS * world)
    engine = _nvme_engine(swap)
    train_engine(engine, rank, world, batches[:1], MB, GAS)
    os.environ[ENV_VAR] = "offload_write:enospc:rank=1"  # counted from here: rank 1's first write of step 2
    start = time.monotonic()
    error = error_of(lambda: train_engine(engine, rank, world, batches[1:], MB, GAS))
    elapsed = time.monotonic() - start
    os.environ.pop(ENV_VAR)
    named = sorted(os.listdir(swap))
    held_before = len(deleted_files_held(swap))
    engine.destroy()  # must not raise the reported failure again
    return {
        "error": error,
        "elapsed": elapsed,
        "named": named,
        "held_before": held_before,
        "held_after": deleted_files_held(swap),
    }


def test_enospc_mid_run_swap_write_fails_every_rank(dist_run, tmp_path: Path) -> None:
    swap = str(tmp_path / "swap")
    for r in dist_run(_step_fails, 2, swap):
        assert r["error"].startswith(
            "SwapIOError: [Errno 28] offload_optimizer step 2 failed on data-parallel rank 1: OSError: [Errno 28] "
            "No space left on device (injected by SHARDSPEED_INJECT='offload_write:enospc:rank=1') (writing "
        ), r["error"]
        assert f"of swap file {swap}/" in r["error"] and "-rank1/swap.bin, unlinked at creation)" in r["error"]
        assert r["elapsed"] < BOUND_S
        assert r["named"] == []  # swap files never have a name on disk
        assert r["held_before"] == 1 and r["held_after"] == {}  # the descriptor is closed by destroy()


def _load_fails(rank: int, world: int, swap: str, where: str) -> dict[str, Any]:
    batches = global_batches(1, MB * GAS * world)
    engine = _nvme_engine(swap)
    train_engine(engine, rank, world, batches, MB, GAS)
    engine.save_checkpoint(where)
    os.environ[ENV_VAR] = "offload_write:enospc:rank=1"  # writing the loaded states into rank 1's swap file
    start = time.monotonic()
    error = error_of(lambda: engine.load_checkpoint(where))
    elapsed = time.monotonic() - start
    os.environ.pop(ENV_VAR)
    engine.destroy()
    return {"error": error, "elapsed": elapsed, "held_after": deleted_files_held(swap)}


@pytest.mark.slow  # the mid-run case above is the default suite's offload-write fault
def test_enospc_writing_loaded_states_to_swap_fails_every_rank(dist_run, tmp_path: Path) -> None:
    swap = str(tmp_path / "swap")
    for r in dist_run(_load_fails, 2, swap, str(tmp_path / "ckpt")):
        assert r["error"].startswith(f"CheckpointError: load_checkpoint from {tmp_path / 'ckpt'} "), r["error"]
        assert " failed on rank 1: OSError: [Errno 28] No space left on device (injected by " in r["error"]
        assert "-rank1/swap.bin, unlinked at creation)" in r["error"]
        assert r["elapsed"] < BOUND_S and r["held_after"] == {}
