"""Reading what a fault-table job left behind (rank logs, torchrun's summary, the checkpoint directory) and
rendering the Markdown table."""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fault_procs import Launch

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Failure|Exit)\b(:.*)?$")
_ERROR_WORDS = ("error", "exception", "fail", "abort", "killed", "timed out", "timeout", "nan", "overflow", "skipp")
MAX_LINE = 160


def last_error_line(text: str) -> str:
    """The last line of a rank's log that looks like an error (an exception line, or a line with an error word
    that is not a traceback's indented source line), else the last non-empty line; trimmed. torch's
    ``[rankN]:`` prefix on a distributed process's traceback is dropped first."""
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if line.strip()]
    if not lines:
        return "(no output)"
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line.strip()) or (
            not line.startswith((" ", "\t")) and any(word in line.lower() for word in _ERROR_WORDS)
        ):
            return trim(line.strip())
    return trim(lines[-1].strip())


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def rank_exit_codes(launcher_text: str) -> dict[int, str]:
    """Per-rank exit codes from torchrun's failure summary ("rank : 1 (local_rank: 1)" / "exitcode : -15
    (pid: N) (SIGTERM)"); ranks that exited 0 are not listed there."""
    codes: dict[int, str] = {}
    for match in _TORCHRUN_FAILURE.finditer(launcher_text):
        code = int(match.group(2))
        codes[int(match.group(1))] = _signal_name(-code) if code < 0 else f"exit {code}"
    return codes


def trim(text: str, limit: int = MAX_LINE) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _natural(path: Path) -> list[int | str]:
    """step2 before step10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def describe_checkpoints(ckpt: Path) -> str:
    """``latest``, committed tags, in-progress / replaced leftovers, files in an NVMe swap directory."""
    if not ckpt.is_dir():
        return "no checkpoint dir"
    latest_file = ckpt / "latest"
    latest = latest_file.read_text().strip() if latest_file.exists() else None
    entries = sorted(ckpt.iterdir(), key=_natural)
    committed = [e.name for e in entries if e.is_dir() and not e.name.startswith(".") and (e / "index.json").exists()]
    incomplete = [e.name for e in entries if e.is_dir() and not e.name.startswith(".") and e.name not in committed]
    tmp = [e.name for e in entries if e.name.startswith(".tmp-")]
    old = [e.name for e in entries if e.name.startswith(".old-")]
    parts = [f"latest={latest}" if latest else "no latest", f"tags: {', '.join(committed) or 'none'}"]
    if incomplete:
        parts.append(f"incomplete: {', '.join(incomplete)}")
    if tmp:
        parts.append(f"{len(tmp)} .tmp-* dir(s)")
    if old:
        parts.append(f"{len(old)} .old-* dir(s)")
    return "; ".join(parts)


def describe_verify(verdict: dict[str, Any]) -> str:
    if verdict.get("loads"):
        finite = "" if verdict.get("finite", True) else ", NOT finite"
        return f"latest loads in a fresh process (step {verdict.get('step')}{finite})"
    return f"latest does NOT load: {trim(str(verdict.get('error')), 120)}"


def max_abs_diff(path_a: Path, path_b: Path) -> float:
    """Max abs difference between two final-parameter files (inf when the keys or shapes differ)."""
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max((float((a[k] - b[k]).abs().max()) for k in a if a[k].numel()), default=0.0)


@dataclass
class RowResult:
    name: str
    title: str
    printed: dict[int, str]
    """rank → its last error line."""
    launcher: str
    """The launcher's exit code (or TIMEOUT) and orphans."""
    time_to_exit: str
    on_disk: str
    resume: str
    notes: list[str] = field(default_factory=list)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(results: Sequence[RowResult]) -> str:
    """The Markdown table: one row per fault; ranks' lines separated by <br>."""
    header = (
        "| fault injected | what every rank printed | launcher | time to exit | on disk afterwards | "
        "resume vs uninterrupted |\n|---|---|---|---|---|---|\n"
    )
    lines = []
    for result in results:
        printed = "<br>".join(f"r{rank}: `{_cell(line)}`" for rank, line in sorted(result.printed.items()))
        cells = [
            f"**{_cell(result.name)}**: {_cell(result.title)}",
            printed or "(no rank logs)",
            _cell(result.launcher),
            _cell(result.time_to_exit),
            _cell(result.on_disk),
            _cell(result.resume),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- **{r.name}**: {_cell(note)}" for r in results for note in r.notes]
    return header + "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def describe_exit(job: Launch) -> str:
    if job.timed_out:
        return "TIMEOUT (hang): killed"
    text = f"exit {job.exit_code}"
    return text + (f"; {job.orphans} orphan(s) killed" if job.orphans else "")


def time_to_exit(job: Launch, fault_time: float | None, timeout_s: float) -> str:
    if job.timed_out:
        since = f" ({job.ended - fault_time:.0f} s after the fault)" if fault_time is not None else ""
        return f"TIMEOUT (hang) after {timeout_s:.0f} s{since}"
    if fault_time is None:
        return f"fault never fired; job ended after {job.ended - job.started:.1f} s"
    return f"{max(0.0, job.ended - fault_time):.1f} s"


def launcher_summary(text: str) -> str:
    """The launcher's own "[shardspeed] ..." verdict line, and the rank torchrun names as the root cause."""
    lines = [line.strip() for line in text.splitlines() if line.startswith("[shardspeed]")]
    first = [line for line in lines if "first failure:" in line]  # the launcher's verdict on which rank and why
    verdicts = first or [line for line in lines if "exited" in line or "interrupted" in line or "failed" in line]
    summary = trim(verdicts[-1], 160) if verdicts else ""
    _, found, after = text.partition("Root Cause (first observed failure)")
    root = _TORCHRUN_FAILURE.search(after) if found else None
    if root is not None:
        summary += f" (torchrun: first failure rank {root.group(1)})"
    return summary.strip()
