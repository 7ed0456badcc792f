"""Checkpoint storage throughput and zero-to-fp32 memory on a synthetic checkpoint.

    python benchmarks/bench_consolidate.py [--size-mib 1024] [--tensor-mib 64] [--ranks 4]
                                           [--max-shard-size 512MB] [--dir DIR] [--bf16]

Writes ``--size-mib`` of parameters (tensors of ``--tensor-mib``, each split evenly over ``--ranks`` fake ranks;
fp32, or bf16 with ``--bf16``) with ``CheckpointWriter`` (copy + crc32 + write + fsync), commits, reads every
tensor back with ``CheckpointReader.read_full`` (checksums verified), then runs ``shardspeed zero-to-fp32`` as a
child process and reports its wall time and its peak RssAnon above the baseline it prints after import (sampled
by the child every millisecond). Throughputs are MiB of checkpoint data per second, page cache warm for reads.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from shardspeed.checkpoint.commit import commit_checkpoint, make_tmp_dir
from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter

MIB = 1 << 20


def write_checkpoint(
    save_dir: Path, size_mib: int, tensor_mib: int, ranks: int, dtype: torch.dtype
) -> tuple[list[str], float]:
    """Write and commit the checkpoint; returns its tensor names and the seconds spent storing (not generating)."""
    generating = 0.0
    started = time.perf_counter()
    tmp_dir = make_tmp_dir(save_dir, "bench", "n")
    writers = [CheckpointWriter(tmp_dir, rank) for rank in range(ranks)]
    names = []
    element_size = torch.empty((), dtype=dtype).element_size()
    for index in range(max(1, size_mib // tensor_mib)):
        numel = tensor_mib * MIB // element_size
        generation_started = time.perf_counter()
        values = torch.randn(numel).to(dtype)
        generating += time.perf_counter() - generation_started
        bounds = [numel * rank // ranks for rank in range(ranks + 1)]
        name = f"param/layer{index}.weight"
        for rank, writer in enumerate(writers):
            writer.add(name, (numel,), bounds[rank], values[bounds[rank] : bounds[rank + 1]])
        names.append(name)
    records = [record for writer in writers for record in writer.finish()]
    commit_checkpoint(save_dir, "bench", tmp_dir, records, {}, True)
    return names, time.perf_counter() - started - generating


def run_consolidation(save_dir: Path, output: Path, max_shard_size: str) -> tuple[float, float]:
    command = [sys.executable, "-m", "shardspeed.launcher.cli", "zero-to-fp32", str(save_dir), str(output)]
    command += ["--max-shard-size", max_shard_size, "--report-rss"]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    started = time.perf_counter()
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - started
    baseline = int(re.search(r"rss-anon-baseline-kib: (\d+)", completed.stderr).group(1))
    peak = int(re.search(r"rss-anon-peak-kib: (\d+)", completed.stderr).group(1))
    return elapsed, (peak - baseline) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--max-shard-size", default="512MB")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    parser.add_argument("--bf16", action="store_true", help="store parameters as bf16 (fp32 conversion on export)")
    options = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(dir=options.dir, prefix="bench-consolidate-"))
    dtype = torch.bfloat16 if options.bf16 else torch.float32
    try:
        save_dir = scratch / "checkpoints"
        names, write_s = write_checkpoint(save_dir, options.size_mib, options.tensor_mib, options.ranks, dtype)
        stored_mib = sum(path.stat().st_size for path in (save_dir / "bench").iterdir()) / MIB
        started = time.perf_counter()
        with CheckpointReader(save_dir / "bench") as reader:
            for name in names:
                reader.read_full(name)
        read_s = time.perf_counter() - started
        export_s, peak_mib = run_consolidation(save_dir, scratch / "fp32", options.max_shard_size)
        largest_mib = max(path.stat().st_size for path in (scratch / "fp32").glob("*.safetensors")) / MIB
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"checkpoint: {stored_mib:.0f} MiB, {len(names)} tensors of {options.tensor_mib} MiB, {options.ranks} ranks")
    print(f"{'step':<34}{'seconds':>10}{'MiB/s':>10}")
    for label, seconds in (("write + fsync + commit", write_s), ("read_full, crc verified", read_s)):
        print(f"{label:<34}{seconds:>10.2f}{stored_mib / seconds:>10.0f}")
    print(f"{'zero-to-fp32 (incl. torch import)':<34}{export_s:>10.2f}{stored_mib / export_s:>10.0f}")
    print(f"zero-to-fp32 peak RssAnon above baseline: {peak_mib:.1f} MiB; largest output shard {largest_mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
