"""Ranks that pass different save directories to save_checkpoint get one error naming both paths, on every rank,
before anything is written (it used to be a commit-time hint about CheckpointWriter.finish() on the committing rank
while the other rank waited in a collective)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardspeed
from harness import RankFailure


def _save_to_own_dir(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    engine.save_checkpoint(str(Path(root) / f"ckpt_rank{rank}"), tag="step1")


def test_different_save_dirs_name_both_paths_on_every_rank(dist_run, tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as failure:
        dist_run(_save_to_own_dir, 2, str(tmp_path), deadline_s=60.0)
    assert sorted(failure.value.errors) == [0, 1]  # both ranks fail: neither is left waiting in a collective
    for kind, message, _ in failure.value.errors.values():
        assert kind == "ValueError"
        assert str(tmp_path / "ckpt_rank0") in message and str(tmp_path / "ckpt_rank1") in message, message
        assert "every rank must pass the same save_dir" in message and "CheckpointWriter.finish" not in message
    # nothing was written: the check runs before the temporary directories are made
    assert not (tmp_path / "ckpt_rank0").exists() and not (tmp_path / "ckpt_rank1").exists()
