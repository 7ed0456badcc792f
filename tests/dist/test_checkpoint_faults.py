"""Disk faults during save_checkpoint and damaged checkpoints at load_checkpoint, world 2 (ZeRO-2: each rank writes
and reads only its own shard's files, so a fault on one rank is invisible to the other unless they agree).

- ENOSPC injected (``SHARDSPEED_INJECT``) into one rank's data, into every rank, into the commit's index.json and
  into ``latest``; and a real full disk (a 2 MiB tmpfs, where mounting is permitted): every rank raises one clear
  error naming the failing rank and the OSError, within a generous bound; ``latest`` still names the previous
  checkpoint, which loads; no ``.tmp-`` directory is left; the next save succeeds.
- A flipped byte, a truncated file and a missing file that only rank 1 reads: every rank raises naming the file
  (and chunk/tensor for the crc mismatch), and the engine's parameters and optimizer state are unchanged.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from disk_full import fill, small_tmpfs  # noqa: F401 (a fixture)
from parity import full_params, global_batches, offload_engine, train_engine

from harness import error_of
from shardspeed.faults.inject import ENV_VAR

MB, GAS = 2, 2
BOUND_S = 30.0  # generous: the agreed error takes well under a second even on a loaded machine


def _engine(stage: int = 2) -> Any:
    return offload_engine({"stage": stage, "reduce_bucket_size": 100}, mb=MB, gas=GAS)


def _rank0_chunk_writes(tag_dir: Path) -> int:
    """How many chunk writes rank 0 makes for a save like the one in ``tag_dir`` (the commit's writes follow)."""
    index = json.loads((tag_dir / "index.json").read_text())
    return sum(c["file"].startswith("rank00000") for t in index["tensors"].values() for c in t["chunks"])


def _spec(phase: str, first: Path) -> str:
    n0 = _rank0_chunk_writes(first)
    return {
        "data": "checkpoint_write:enospc:rank=1:after=1",  # rank 1's second chunk
        "all": "checkpoint_write:enospc",  # the first write everywhere
        "index": f"checkpoint_write:enospc:rank=0:after={n0}",  # rank 0's index.json, in the commit
        "latest": f"checkpoint_write:enospc:rank=0:after={n0 + 2}",  # after index.json and metadata.json
    }[phase]


def _save_fails(rank: int, world: int, where: str, phase: str | None) -> dict[str, Any]:
    """Train, save 'first', train on, save 'second' under a disk fault; then what is on disk, and a fresh
    engine's load of ``latest`` compared with the values saved in 'first'; then 'second' saved again."""
    batches = global_batches(3, MB * GAS * world)
    engine = _engine()
    train_engine(engine, rank, world, batches[:2], MB, GAS)
    engine.save_checkpoint(where, tag="first")
    saved = full_params(engine)
    train_engine(engine, rank, world, batches[2:], MB, GAS)
    if phase is not None:
        os.environ[ENV_VAR] = _spec(phase, Path(where) / "first")
    elif rank == 0:  # a real full disk: fill what the first checkpoint left free
        fill(Path(where) / "filler")
    dist.barrier()
    start = time.monotonic()
    error = error_of(lambda: engine.save_checkpoint(where, tag="second"))
    elapsed = time.monotonic() - start
    os.environ.pop(ENV_VAR, None)
    if rank == 0:
        (Path(where) / "filler").unlink(missing_ok=True)
    dist.barrier()  # every rank is past its error (rank 0 has cleaned up) before anyone looks
    listing = sorted(os.listdir(where))
    latest = (Path(where) / "latest").read_text()
    dist.barrier()
    fresh = _engine()
    path, _ = fresh.load_checkpoint(where)
    loaded = full_params(fresh)
    same = all(torch.equal(loaded[n], saved[n]) for n in saved)
    engine.save_checkpoint(where, tag="second")  # the disk has room again: the retry commits
    return {
        "error": error,
        "elapsed": elapsed,
        "listing": listing,
        "latest": latest,
        "loaded": Path(path).name,
        "same": same,
        "latest_after_retry": (Path(where) / "latest").read_text(),
    }


def _check_agreed_failure(results: list[dict[str, Any]], rank: str, culprit: str, committed: bool) -> None:
    for r in results:
        assert r["error"].startswith("CheckpointWriteError: [Errno 28] save_checkpoint to "), r["error"]
        assert f"failed on rank {rank}: OSError: [Errno 28] " in r["error"], r["error"]
        assert "No space left on device" in r["error"], r["error"]
        assert culprit in r["error"], r["error"]
        assert r["elapsed"] < BOUND_S
        assert r["latest"] == "first"  # the previous checkpoint stays the one to load...
        assert r["loaded"] == "first" and r["same"]  # ...and loads
        assert not [name for name in r["listing"] if name.startswith(".tmp-")]  # no half-written tag visible
        assert ("second" in r["listing"]) == committed
        assert r["latest_after_retry"] == "second"


@pytest.mark.parametrize(
    ("phase", "rank", "culprit", "committed"),
    [
        ("data", "1", "rank00001-000.safetensors", False),
        pytest.param("all", "0", "(and on 1 more rank(s): 1)", False, marks=pytest.mark.slow),
        pytest.param("index", "0", "index.json", False, marks=pytest.mark.slow),
        pytest.param(
            "latest",
            "0",
            "is complete, but 'latest' could not be updated and still names 'first'",
            True,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_enospc_during_save_keeps_latest(
    dist_run, tmp_path: Path, phase: str, rank: str, culprit: str, committed: bool
) -> None:
    results = dist_run(_save_fails, 2, str(tmp_path / "ckpt"), phase)
    _check_agreed_failure(results, rank, culprit, committed)


@pytest.mark.slow  # the injected cases above are the default suite's save fault
def test_real_full_disk_during_save_keeps_latest(dist_run, small_tmpfs: Path) -> None:  # noqa: F811
    results = dist_run(_save_fails, 2, str(small_tmpfs / "ckpt"), None)
    for r in results:  # which rank hits the full disk first is up to the scheduler
        assert "No space left on device" in r["error"] and "failed on rank " in r["error"], r["error"]
        assert f"No space left on device: '{small_tmpfs}/ckpt/" in r["error"]  # names the file it was writing
    _check_agreed_failure(results, results[0]["error"].split("failed on rank ")[1][0], "", False)


def _snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters, fp32 master shards and optimizer states, copied."""
    engine.states.wait_params()  # direct reads below: land pending parameter gathers first
    out = {f"param/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, piece in enumerate(engine.states.checkpoint_pieces()):
        out[f"piece{i}/{piece.name}"] = piece.value.detach().clone()
    for i, state in enumerate(engine.optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim{i}/{key}"] = value.detach().clone()
    return out


def _load_damaged(rank: int, world: int, where: str, stage: int) -> dict[str, Any]:
    """Save at step 2, then for each damage to rank 1's file: a trained-on engine's failed load (message, time,
    state before vs after)."""
    batches = global_batches(3, MB * GAS * world)
    engine = _engine(stage)
    train_engine(engine, rank, world, batches[:2], MB, GAS)
    engine.save_checkpoint(where, tag="good")
    train_engine(engine, rank, world, batches[2:], MB, GAS)
    victim = Path(where) / "good" / "rank00001-000.safetensors"
    pristine = victim.read_bytes()
    out: dict[str, Any] = {}
    for damage in ("flip", "truncate", "missing"):
        dist.barrier()
        if rank == 0:
            data = bytearray(pristine)
            if damage == "flip":
                data[-5] ^= 0xFF  # inside the last chunk's data
                victim.write_bytes(bytes(data))
            elif damage == "truncate":
                victim.write_bytes(bytes(data[: len(data) // 2]))
            else:
                victim.unlink()
        dist.barrier()
        before = _snapshot(engine)
        start = time.monotonic()
        error = error_of(lambda: engine.load_checkpoint(where))
        elapsed = time.monotonic() - start
        after = _snapshot(engine)
        unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        out[damage] = {"error": error, "elapsed": elapsed, "unchanged": unchanged, "steps": engine.global_steps}
    return out


# stage 2: only rank 1 reads the damaged file (its peer used to wait in the load's all-gather); stage 0: both read
# it, and the parameters read before the damaged chunk used to stay loaded
@pytest.mark.parametrize("stage", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_damaged_checkpoint_fails_every_rank_and_changes_nothing(dist_run, tmp_path: Path, stage: int) -> None:
    where = tmp_path / "ckpt"
    results = dist_run(_load_damaged, 2, str(where), stage)
    victim = str(where / "good" / "rank00001-000.safetensors")
    expected = {
        "flip": ["CheckpointCorruptError", "failed on rank 1", f"checkpoint data file {victim} is corrupt: chunk "],
        "truncate": ["CheckpointCorruptError", "failed on rank 1", f"{victim} (holding tensor ", "is truncated"],
        "missing": ["CheckpointCorruptError", "failed on rank 1", f"{victim} (holding tensor ", "is missing"],
    }
    for rank, result in enumerate(results):
        for damage, parts in expected.items():
            r = result[damage]
            if stage == 0:  # every rank reads the file; the first failing rank reported is rank 0
                parts = [part.replace("failed on rank 1", "failed on rank 0") for part in parts]
            for part in parts:
                assert part in r["error"], (rank, damage, r["error"])
            assert r["elapsed"] < BOUND_S
            assert r["unchanged"], (rank, damage)  # no half-loaded weights or optimizer states
            assert r["steps"] == 3  # nor counters
    flip = results[0]["flip"]["error"]
    assert "of tensor 'optim/" in flip or "of tensor 'param/" in flip
    assert "has crc32 0x" in flip and "index.json recorded 0x" in flip


def _latest_on_one_rank_only(rank: int, world: int, where: str) -> dict[str, Any]:
    """Rank 0 loads from a directory holding a checkpoint, rank 1 from an empty one (a directory that is not
    shared): both must stop at the same agreement instead of rank 1 returning while rank 0 reads on."""
    engine = _engine()
    train_engine(engine, rank, world, global_batches(1, MB * GAS * world), MB, GAS)
    engine.save_checkpoint(str(Path(where) / "saved"))
    mine = Path(where) / ("saved" if rank == 0 else f"empty{rank}")
    mine.mkdir(exist_ok=True)
    start = time.monotonic()
    error = error_of(lambda: engine.load_checkpoint(str(mine)))
    # the engine is still usable and in step: one more training step pairs its collectives normally
    after = error_of(lambda: train_engine(engine, rank, world, global_batches(1, MB * GAS * world), MB, GAS))
    return {"error": error, "after": after, "seconds": time.monotonic() - start}


def test_latest_seen_by_some_ranks_only_is_one_error_everywhere(dist_run, tmp_path: Path) -> None:
    results = dist_run(_latest_on_one_rank_only, 2, str(tmp_path))
    for r in results:
        assert r["error"].startswith("ValueError: whether") and "holds a checkpoint" in r["error"], r["error"]
        assert r["after"] == "no error"
        assert r["seconds"] < BOUND_S
    assert results[0]["error"] == results[1]["error"]
