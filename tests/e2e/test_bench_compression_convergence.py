"""``benchmarks/bench_compression_convergence.py`` at a tiny size: the ZeRO-2 1-bit Adam variant at world 2, two
seeds, compression on and off, 12 steps (freeze_step 2). Checks the job runs end to end, on and off start from the
same losses (same seeds, same batches; the warm-up is exact), the table and the PNG are written. Starts processes:
slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compression_convergence.py"


@pytest.mark.slow
def test_tiny_convergence_run(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH), "--optimizers", "zero2-onebitadam", "--worlds", "2", "--steps", "12"]
    command += ["--seeds", "2", "--freeze-frac", "0.2", "--out", str(tmp_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert completed.returncode in (0, 1), completed.stdout[-3000:] + completed.stderr[-3000:]  # 1: a row failed
    result = json.loads((tmp_path / "zero2-onebitadam-w2.json").read_text())
    runs = result["runs"]
    assert result["world"] == 2 and len(runs) == 4
    for seed in (0, 1):
        on, off = (next(r["losses"] for r in runs if r["seed"] == seed and r["compressed"] == c) for c in (1, 0))
        assert len(on) == 12 and on[:3] == off[:3]  # steps 1-3 are exact in both (compression from step 4)
        assert on[3:] != off[3:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["variant"] == "zero2-onebitadam" and row["seeds"] == 2
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    assert "zero2-onebitadam" in (tmp_path / "table.txt").read_text()
