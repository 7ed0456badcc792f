"""benchmarks/fault_table.py end to end on two quick rows: real 2-rank launches through the shardspeed launcher.

``corrupt_byte`` (a byte flipped in the latest checkpoint of the uninterrupted run, then resumed) and ``nan_input``
(a NaN in rank 1's batch) share one uninterrupted baseline, so the test is one baseline launch, two row launches
and two single-process verifications. The assertions hold for today's behaviour and for the fixed one: they check
that the harness measured and rendered what happened, not what should happen.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cells(line: str) -> list[str]:
    # Split on the table's own separators, not on escaped pipes inside cells.
    return [cell.strip() for cell in line.replace("\\|", "\0").strip().strip("|").split("|")]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fault_table_runs_rows_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(REPO / "benchmarks" / "fault_table.py"), "--rows", "corrupt_byte,nan_input"]
    command += ["--workdir", str(tmp_path / "work"), "--out", str(out), "--timeout", "240"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1400)  # backstop only
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    lines = table.splitlines()
    assert lines[0].startswith("| fault injected | what every rank printed | launcher | time to exit |")
    rows = [line for line in lines[2:] if line.startswith("| **")]
    assert [row.split("**")[1] for row in rows] == ["corrupt_byte", "nan_input"]
    for row in rows:
        cells = _cells(row)
        assert len(cells) == 6, row
        assert "r0: `" in cells[1] and "r1: `" in cells[1], row  # every rank's line is shown
        assert "fault never fired" not in cells[3], row  # both faults fire on today's code
        assert cells[3].endswith(" s"), row
    corrupt, nan = (_cells(row) for row in rows)
    assert "latest does NOT load" in corrupt[4]  # the flipped byte is caught by the checkpoint's crc32
    assert "latest=step8" in corrupt[4]
    assert "- **corrupt_byte**: flipped byte" in table
    assert "latest loads in a fresh process" in nan[4] or "latest does NOT load" in nan[4]
    assert nan[5].startswith("n/a")
    # The work directory keeps every rank's own log.
    assert sorted(p.name.split("_")[-1] for p in (tmp_path / "work" / "nan_input" / "run" / "logs").iterdir()) == [
        "rank0.log",
        "rank1.log",
    ]
