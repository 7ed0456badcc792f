"""The fault table's pure parts: reading rank logs, describing a checkpoint directory, damaging a file, rendering.

The launched rows themselves run in tests/e2e/test_fault_table.py (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fault_procs import Launch, descendants
from fault_report import (
    RowResult,
    describe_checkpoints,
    describe_exit,
    last_error_line,
    launcher_summary,
    rank_exit_codes,
    render_table,
    time_to_exit,
)
from fault_rows import (
    ROWS,
    ROWS_BY_NAME,
    baseline_key,
    corrupt_byte,
    make_spec,
    rank_file,
    select_rows,
    truncate_half,
)

TRACEBACK = """[fault_table] rank 1: training steps 1..8
Traceback (most recent call last):
  File "/x/fault_table_script.py", line 10, in <module>
    raise RuntimeError("boom")
RuntimeError: fault_table: injected exception in engine forward on rank 1 at step 3
"""


def test_last_error_line_is_the_exception_line_of_a_traceback() -> None:
    assert (
        last_error_line(TRACEBACK)
        == "RuntimeError: fault_table: injected exception in engine forward on rank 1 at step 3"
    )


def test_last_error_line_prefers_a_later_error_word_line_over_earlier_ones_and_skips_source_lines() -> None:
    text = "ValueError: first\n[shardspeed rank0] step 7: gradient norm is nan; stepping anyway\n    raise Error('x')\n"
    assert last_error_line(text) == "[shardspeed rank0] step 7: gradient norm is nan; stepping anyway"


def test_last_error_line_falls_back_to_the_last_line_and_says_when_there_is_none() -> None:
    assert (
        last_error_line("hello\n[fault_table] rank 0: finished at step 8\n\n")
        == "[fault_table] rank 0: finished at step 8"
    )
    assert last_error_line("") == "(no output)"
    assert last_error_line("\n  \n") == "(no output)"


def test_last_error_line_drops_torchs_rank_prefix_before_reading_a_traceback() -> None:
    text = (
        '[rank0]: Traceback (most recent call last):\n[rank0]:   File "errors.py", line 1\n[rank0]: ValueError: bad\n'
    )
    assert last_error_line(text) == "ValueError: bad"
    assert last_error_line('[rank0]:   File "errors.py", line 1\n[rank0]: done\n') == "done"


TORCHRUN_SUMMARY = """Failures:
[1]:
  time      : 2026-12-01_20:43:31
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 30673)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 30672)
"""


def test_rank_exit_codes_from_torchruns_summary() -> None:
    assert rank_exit_codes(TORCHRUN_SUMMARY) == {1: "SIGTERM", 0: "exit 1"}
    assert rank_exit_codes("[shardspeed] nothing failed") == {}


def test_launcher_summary_names_torchruns_root_cause() -> None:
    text = TORCHRUN_SUMMARY + "[shardspeed] node 0 (localhost) exited with code 1; stopping the others\n"
    assert launcher_summary(text) == (
        "[shardspeed] node 0 (localhost) exited with code 1; stopping the others (torchrun: first failure rank 0)"
    )
    assert launcher_summary("[shardspeed] node 0: python -m torch.distributed.run ...\n") == ""


def test_last_error_line_is_trimmed() -> None:
    line = last_error_line("RuntimeError: " + "x" * 500)
    assert len(line) == 160 and line.endswith("…") and line.startswith("RuntimeError: xxx")


def _result(name: str, printed: dict[int, str], notes: list[str] | None = None) -> RowResult:
    return RowResult(name, f"title of {name}", printed, "exit 1", "3.2 s", "latest=step4", "n/a", notes or [])


def test_render_table_has_one_row_per_result_ranks_in_order_and_escapes_pipes() -> None:
    table = render_table(
        [
            _result("a", {1: "RuntimeError: rank 1 | boom", 0: "(no output)"}),
            _result("b", {0: "ok", 1: "ok"}, notes=["flipped byte 12 of x"]),
        ]
    )
    lines = table.splitlines()
    assert lines[0].startswith("| fault injected | what every rank printed |")
    assert set(lines[1].replace("|", "")) == {"-"}
    assert lines[2].count(" | ") == 5 and lines[3].count(" | ") == 5  # six cells each, no stray pipe
    assert "r0: `(no output)`<br>r1: `RuntimeError: rank 1 \\| boom`" in lines[2]
    assert lines[2].startswith("| **a**: title of a |")
    assert "- **b**: flipped byte 12 of x" in table


def test_render_table_of_a_row_without_logs() -> None:
    assert "(no rank logs)" in render_table([_result("x", {})])


def _launch(**overrides: object) -> Launch:
    values = dict(exit_code=1, timed_out=False, started=100.0, ended=112.5, orphans=0, launcher_stderr="", rank_logs={})
    values.update(overrides)
    return Launch(**values)  # type: ignore[arg-type]


def test_exit_and_time_cells() -> None:
    assert describe_exit(_launch()) == "exit 1"
    assert describe_exit(_launch(orphans=2)) == "exit 1; 2 orphan(s) killed"
    assert describe_exit(_launch(timed_out=True, exit_code=None)) == "TIMEOUT (hang): killed"
    assert time_to_exit(_launch(), 110.0, 180) == "2.5 s"
    assert time_to_exit(_launch(), None, 180) == "fault never fired; job ended after 12.5 s"
    assert (
        time_to_exit(_launch(timed_out=True, ended=290.0), 110.0, 180)
        == "TIMEOUT (hang) after 180 s (180 s after the fault)"
    )


def test_describe_checkpoints(tmp_path: Path) -> None:
    assert describe_checkpoints(tmp_path / "missing") == "no checkpoint dir"
    for tag in ("step10", "step2", "step4"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "index.json").write_text("{}")
    (tmp_path / "step6").mkdir()  # no index.json: not committed
    (tmp_path / ".tmp-step6-abc").mkdir()
    (tmp_path / "latest").write_text("step4\n")
    expected = "latest=step4; tags: step2, step4, step10; incomplete: step6; 1 .tmp-* dir(s)"
    assert describe_checkpoints(tmp_path) == expected


def _fake_safetensors(path: Path, payload: bytes) -> None:
    header = json.dumps({"t": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + payload)


def test_corrupt_byte_flips_exactly_one_byte_of_the_tensor_data(tmp_path: Path) -> None:
    path = tmp_path / "rank1-0.safetensors"
    _fake_safetensors(path, bytes(range(100)))
    before = path.read_bytes()
    corrupt_byte(path)
    after = path.read_bytes()
    changed = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    header_end = 8 + int.from_bytes(before[:8], "little")
    assert len(before) == len(after) and len(changed) == 1 and changed[0] >= header_end


def test_the_damaged_file_is_the_named_ranks(tmp_path: Path) -> None:
    for name in ("rank00000-000.safetensors", "rank00001-000.safetensors", "rank00010-000.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert rank_file(tmp_path, 1).name == "rank00001-000.safetensors"
    assert rank_file(tmp_path, 10).name == "rank00010-000.safetensors"
    assert rank_file(tmp_path, 3).name == "rank00000-000.safetensors"  # none of its own: the first


def test_truncate_half(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    _fake_safetensors(path, bytes(100))
    size = path.stat().st_size
    assert truncate_half(path).endswith(f"from {size} to {size // 2} bytes")
    assert path.stat().st_size == size // 2


def test_rows_cover_the_issue_list_and_select_rows_names_an_unknown_row() -> None:
    names = set(ROWS_BY_NAME)
    for expected in (
        *(f"exc_{p}" for p in ("forward", "backward", "step", "save", "load", "initialize", "user")),
        "collective_mismatch",
        *(f"kill_{p}" for p in ("step", "backward", "save")),
        "sigterm_launcher",
        "enospc_save",
        "enospc_offload_setup",
        "enospc_offload_write",
        "corrupt_byte",
        "truncated_file",
        "nan_input",
        "fp16_storm",
    ):
        assert expected in names
    assert [row.name for row in select_rows("nan_input, corrupt_byte")] == ["nan_input", "corrupt_byte"]
    assert select_rows(None) == list(ROWS)
    with pytest.raises(SystemExit, match="unknown row 'nan_inptu'"):
        select_rows("nan_inptu")


def test_specs_baselines_and_resume(tmp_path: Path) -> None:
    sigterm = ROWS_BY_NAME["sigterm_launcher"]
    spec = make_spec(sigterm, tmp_path, fault=True)
    assert spec["fault"] == sigterm.fault and spec["checkpoint_dir"] == str(tmp_path / "ckpt")
    assert spec["config"]["fault_tolerance"]["checkpoint_dir"] == str(tmp_path / "ckpt")  # "{row}" filled in
    assert spec["config"]["fault_tolerance"]["collective_timeout_s"] > 0
    resumed = make_spec(sigterm, tmp_path, fault=False, auto_resume=True)
    assert resumed["fault"] is None and resumed["config"]["fault_tolerance"]["auto_resume"] is True
    # Rows that differ only in their fault (and fault_tolerance keys) share the uninterrupted baseline.
    assert baseline_key(ROWS_BY_NAME["exc_forward"]) == baseline_key(ROWS_BY_NAME["collective_mismatch"])
    assert baseline_key(ROWS_BY_NAME["exc_forward"]) != baseline_key(ROWS_BY_NAME["exc_backward"])  # stage 3
    assert baseline_key(ROWS_BY_NAME["exc_forward"]) != baseline_key(ROWS_BY_NAME["fp16_storm"])


def test_descendants_finds_a_grandchild() -> None:
    sleeper = "import time; time.sleep(30)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        found: list[int] = []
        for _ in range(100):
            found = descendants(child.pid)
            if found:
                break
            time.sleep(0.05)
        assert len(found) == 1  # the grandchild, not the child itself
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()
