"""``benchmarks/bench_engine.py`` end to end at the smallest size: one round of one step of stage 1, its "before"
row and its peer on the comm-bound MLP, 2 gloo ranks, no memory runs. Checks what the issue's figures rest on: the
rows train the same thing (equal losses), the exposed-communication meter was read for the shardspeed rows (and
only for them), and the report pairs before with after. Starts processes (about a minute on 2 shared cores): slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


@pytest.mark.slow
def test_bench_engine_mlp_stage1_before_after(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    command = [sys.executable, str(BENCH), "--model", "mlp", "--rows", "stage1,stage1_before", "--rounds", "1"]
    command += ["--steps", "1", "--warmup", "1", "--skip-memory", "--json", str(raw)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (model,) = json.loads(raw.read_text())["models"]
    timing = model["timing"]
    assert list(timing["step_ms"]) == ["stage1", "zero_redundancy", "stage1_before"]
    assert timing["parameters"] == 6_297_600 and timing["world"] == 2
    losses = timing["final_loss"]
    assert abs(losses["stage1"] - losses["zero_redundancy"]) < 1e-4
    assert abs(losses["stage1_before"] - losses["zero_redundancy"]) < 1e-4
    assert set(timing["blocked_ms"]) == {"stage1", "stage1_before"}  # torch rows have no meter
    (keys,) = timing["blocked_ms"]["stage1_before"]  # one round
    assert any(key.endswith(":grads") for key in keys) and any(key.endswith(":params") for key in keys)
    assert "stage1 after/before: step time" in completed.stdout
    assert "≤ 0.95" in completed.stdout
