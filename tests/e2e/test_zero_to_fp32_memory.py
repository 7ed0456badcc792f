"""``shardspeed zero-to-fp32`` on a checkpoint of more than 1 GiB streams: its peak anonymous resident memory
(RssAnon: heap and tensors, not the page cache of the files it maps) above its baseline right after import
stays below 1.25x the largest output shard.

The checkpoint (12 fp32 tensors of 32-128 MiB and one 64 MiB bf16 tensor) is written in this process by four fake
ranks (each tensor's range split over them); the CLI runs
as a child process with the hidden ``--report-rss`` flag: it prints its RssAnon baseline once imports are done and
its own 1 ms-sampled peak at exit. This test also samples the child's /proc/<pid>/status every few milliseconds
and takes the larger peak, so a short spike missed by one sampler is caught by the other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardspeed.checkpoint.commit import commit_checkpoint, make_tmp_dir
from shardspeed.checkpoint.consolidate import parse_size
from shardspeed.checkpoint.store import CheckpointWriter

REPO_SRC = Path(__file__).resolve().parents[2] / "src"
MIB = 1 << 20
TENSOR_MIB = [128, 96, 64, 128, 32, 96, 128, 64, 96, 64, 128, 32]  # 1056 MiB in all
NUM_RANKS = 4
MAX_SHARD = "256MB"


def expected_tensor(index: int, numel: int) -> torch.Tensor:
    """Cheap, distinct, exactly reproducible values for tensor ``index``."""
    return torch.arange(numel, dtype=torch.float32).mul_(1.0 / 1024).add_(index * 1000.0)


def write_big_checkpoint(save_dir: Path) -> int:
    tmp_dir = make_tmp_dir(save_dir, "global_step1", "n")
    writers = [CheckpointWriter(tmp_dir, rank, file_bytes=256 * MIB) for rank in range(NUM_RANKS)]
    total = 0
    for index, mib in enumerate(TENSOR_MIB):
        numel = mib * MIB // 4
        values = expected_tensor(index, numel)
        bounds = [numel * rank // NUM_RANKS for rank in range(NUM_RANKS + 1)]
        for rank, writer in enumerate(writers):
            writer.add(
                f"param/layer{index}.weight",
                (numel // 1024, 1024),
                bounds[rank],
                values[bounds[rank] : bounds[rank + 1]],
            )
        total += values.numel() * 4
        del values
    # One parameter stored as bf16 (64 MiB): its fp32 conversion is real anonymous memory, one chunk at a time,
    # which shows the measurement sees allocations (fp32 pieces come from the file mapping, not the heap).
    bf16 = expected_tensor(len(TENSOR_MIB), 32 * MIB).to(torch.bfloat16)
    writers[1].add("param/head.weight", (32 * MIB,), 0, bf16)
    total += bf16.numel() * 2
    del bf16
    records = [record for writer in writers for record in writer.finish()]
    commit_checkpoint(save_dir, "global_step1", tmp_dir, records, {}, True)
    return total


def rss_anon_kib(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    match = re.search(r"^RssAnon:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


@pytest.mark.timeout(300)
def test_zero_to_fp32_peak_rss_stays_below_the_largest_shard(tmp_path: Path) -> None:
    save_dir, output = tmp_path / "checkpoints", tmp_path / "fp32"
    try:
        checkpoint_bytes = write_big_checkpoint(save_dir)
        assert checkpoint_bytes >= 2**30
        command = [
            sys.executable, "-m", "shardspeed.launcher.cli", "zero-to-fp32",
            str(save_dir), str(output), "--max-shard-size", MAX_SHARD, "--report-rss",
        ]  # fmt: skip
        environment = {**os.environ, "PYTHONPATH": str(REPO_SRC), "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sampled_peak_kib = 0
        while child.poll() is None:
            sampled_peak_kib = max(sampled_peak_kib, rss_anon_kib(child.pid) or 0)
            time.sleep(0.002)
        stdout, stderr = child.communicate(timeout=60)
        assert child.returncode == 0, stderr
        baseline_kib = int(re.search(r"rss-anon-baseline-kib: (\d+)", stderr).group(1))
        self_peak_kib = int(re.search(r"rss-anon-peak-kib: (\d+)", stderr).group(1))
        peak_above_baseline = (max(sampled_peak_kib, self_peak_kib) - baseline_kib) * 1024

        shards = sorted(output.glob("model-*-of-*.safetensors"))
        assert len(shards) > 1 and (output / "model.safetensors.index.json").is_file()
        assert [Path(line).name for line in stdout.split()] == [
            *(p.name for p in shards),
            "model.safetensors.index.json",
        ]
        largest_shard = max(path.stat().st_size for path in shards)
        assert largest_shard <= parse_size(MAX_SHARD) + 4096  # 4096: room for the header
        print(
            f"\nzero-to-fp32 on {checkpoint_bytes / MIB:.0f} MiB: peak RssAnon above baseline "
            f"{peak_above_baseline / MIB:.1f} MiB (parent-sampled {(sampled_peak_kib - baseline_kib) / 1024:.1f}, "
            f"self-sampled {(self_peak_kib - baseline_kib) / 1024:.1f}); largest shard {largest_shard / MIB:.1f} "
            f"MiB, {len(shards)} shards; limit {1.25 * largest_shard / MIB:.1f} MiB"
        )
        assert peak_above_baseline < 1.25 * largest_shard

        found = {}
        for path in shards:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 — safe_open objects are not mappings
                    found[key] = handle.get_tensor(key)
        assert sorted(found) == sorted([*(f"layer{i}.weight" for i in range(len(TENSOR_MIB))), "head.weight"])
        head = found.pop("head.weight")
        assert head.dtype == torch.float32
        assert torch.equal(head, expected_tensor(len(TENSOR_MIB), 32 * MIB).to(torch.bfloat16).float())
        for index, mib in enumerate(TENSOR_MIB):
            tensor = found.pop(f"layer{index}.weight")
            assert tensor.shape == (mib * MIB // 4 // 1024, 1024)
            assert torch.equal(tensor.reshape(-1), expected_tensor(index, tensor.numel()))
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(output, ignore_errors=True)
