"""The pipeline benchmark's table (``benchmarks/bench_pipe_report.py``): pure, from a hand-made results dict."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_pipe_report import format_report


def _rounds(steps: list[float], bubble: float = 0.1) -> list[dict[str, float]]:
    return [{"step_ms": s, "bubble": bubble, "wait_ms": 5.0, "post_ms": 1.0} for s in steps]


def _report(deepspeed: dict | None) -> dict:
    rounds = {
        "shardspeed-1f1b": _rounds([100.0, 120.0, 110.0]),
        "torch-1f1b": _rounds([200.0, 200.0, 100.0]),
    }
    losses = {"shardspeed-1f1b": [5.0, 4.9], "torch-1f1b": [5.0, 4.9]}
    return {
        "timing": {"world": 2, "model": "tiny", "by_m": {"4": {"rounds": rounds, "first_losses": losses}}},
        "deepspeed": deepspeed,
        "memory": {"shardspeed-1f1b": [{"micro_batches": 4, "growth_mib": [30.0, 42.0]}], "torch-1f1b": []},
    }


def test_rows_ratios_per_round_memory_and_missing_deepspeed() -> None:
    text = format_report(_report(None))
    assert "theoretical bubble (p-1)/(m+p-1) = 0.200" in text
    row = next(line for line in text.splitlines() if line.startswith("shardspeed-1f1b"))
    # step medians over rounds with the IQR; per-round ratios 0.5, 0.6, 1.1 → median 0.60 [0.55–0.85]
    assert "110.0 [105.0–115.0]" in row
    assert "/torch-1f1b 0.60 [0.55–0.85] (per round)" in row
    assert " 42 " in row  # peak growth: the larger rank's
    assert "DeepSpeed: not installed" in text
    assert "shardspeed-1f1b 5.00000, 4.90000; torch-1f1b 5.00000, 4.90000" in text


def test_deepspeed_rows_compare_by_medians() -> None:
    ds = {"version": "0.19.8", "by_m": {"4": {"rounds": _rounds([220.0, 220.0]), "first_losses": [5.0, 4.9],
                                              "parts": [0, 6, 12], "growth_mib": [100.0, 139.0]}}}  # fmt: skip
    text = format_report(_report(ds))
    ds_row = next(line for line in text.splitlines() if line.startswith("deepspeed-1f1b"))
    assert "220.0" in ds_row and " 139 " in ds_row
    row = next(line for line in text.splitlines() if line.startswith("shardspeed-1f1b"))
    assert "/deepspeed 0.50 (medians)" in row  # 110 / 220
    assert "DeepSpeed 0.19.8 partition: [0, 6, 12]" in text
    assert "not installed" not in text
