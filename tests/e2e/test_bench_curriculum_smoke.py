"""The curriculum benchmark (``benchmarks/bench_curriculum.py``) end to end at tiny size: both runs reach the same
token budget, the curriculum run takes more, shorter steps (growing to the full context), the held-out curve starts
at the same loss (same seed) and the PNG is written. Slow: it reads the corpus and trains two engines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.slow
def test_bench_curriculum_tiny(tmp_path: Path) -> None:
    from bench_curriculum import main

    out = tmp_path / "bench"
    args = ["--budget-steps", "6", "--curriculum-steps", "4", "--eval-every", "4000", "--repeats", "2"]
    args += ["--timed-steps", "1", "--context", "32", "--min-seqlen", "8", "--corpus-bytes", "200000"]
    results = main([*args, "--out", str(out)])
    base, cur = results["baseline"], results["curriculum"]
    assert base["curve"][0] == cur["curve"][0]  # same seed, same model before training
    assert cur["steps"] > base["steps"] and cur["lengths"][0] < 32 and cur["lengths"][-1] == 32
    assert cur["curve"][-1][0] >= base["curve"][-1][0] == 6 * 16 * 32
    assert (out / "curriculum.png").stat().st_size > 1000
    assert len(results["throughput"]["gain_per_round"]) == 2
