"""The fault table of issue #13: every fault run as a real launched 2-rank job, one Markdown row each.

    python benchmarks/fault_table.py [--rows NAME,...] [--out TABLE.md] [--timeout S] [--workdir DIR] [--list]

Each row writes a spec (``ROW/spec.json``) for ``fault_table_script.py`` and launches it with the shardspeed
launcher (``python -m shardspeed.launcher.cli --num_procs 2 --enable_each_rank_log ...``), then reports:

- **what every rank printed**: the last error-looking line of each rank's own log (else its last line), so the
  row shows whether each rank named the failing rank; and the launcher's exit code;
- **time to exit**: from the fault (the wall-clock time the injecting rank wrote into ``fault.json`` just before
  injecting; for SIGTERM, when the harness sent it) to the last process of the launch exiting. A launch still
  running after ``--timeout`` seconds is killed, the launcher and everything below it, and the row says
  ``TIMEOUT (hang)``: that is a finding, not a harness failure. Processes that outlive the launcher are counted
  as orphans (the harness is their subreaper, so they cannot escape to init) and killed;
- **on disk afterwards**: the checkpoint directory's ``latest``, committed tags, leftover ``.tmp-*`` / ``.old-*``
  directories, and whether the latest checkpoint loads in a fresh single-process run (``--verify``);
- **resume**: where it applies, a second launch resumes (``--resume`` = ``load_checkpoint(latest)``, or the
  config's ``auto_resume`` for the preemption row) and runs to the end; its final parameters are compared with an
  uninterrupted run of the same config (max abs difference; equal means <= 1e-6).

Uninterrupted baselines are run once per distinct (stage, precision, config, steps). Rows whose behaviour is
built on other branches show today's behaviour until those are merged (hangs, "stepping anyway").
The work directory (logs, checkpoints, specs) is kept; its path is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_SRC = BENCH_DIR.parent / "src"
SCRIPT = BENCH_DIR / "fault_table_script.py"
NPROC = 2
DEFAULT_TIMEOUT_S = 180.0
VERIFY_TIMEOUT_S = 120.0
ORPHAN_GRACE_S = 10.0
EQUAL_TOLERANCE = 1e-6
PORT_TAKEN_SIGNATURE = "EADDRINUSE"
# The process-group timeout every row's job runs with: a rank waiting for a dead peer should fail after this
# (+ the 10 s), not after torch's default 30 minutes. Only effective once initialize reads the field.
COLLECTIVE_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    """One fault: how it is injected (``fault``, read by the script), the job's shape, and what follows."""

    name: str
    title: str
    """The "fault injected" cell."""
    fault: dict[str, Any] | None
    stage: int = 2
    precision: str = "fp32"
    steps: int = 8
    save_every: int = 2
    config: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    """Relaunch with resume after the fault and compare with the uninterrupted run."""
    damage: str | None = None
    """``corrupt`` / ``truncate``: damage the latest checkpoint of a copy of the baseline's, then the launch
    resumes from it (the fault is the load)."""
    sigterm_launcher: bool = False
    """Send SIGTERM to the launcher once the script writes its marker (the preemption row)."""


def _inject(point: str, rank: int, step: int, inject: str) -> dict[str, Any]:
    return {"point": point, "kind": "inject", "rank": rank, "step": step, "inject": inject}


_NVME = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "{row}/nvme"}}}

ROWS: tuple[Row, ...] = (
    Row(
        "exc_forward",
        "exception on rank 1 in forward (step 3, ZeRO-2)",
        {"point": "forward", "rank": 1, "step": 3},
        resume=True,
    ),
    Row(
        "exc_backward",
        "exception on rank 1 in backward (step 3, ZeRO-3)",
        {"point": "backward", "rank": 1, "step": 3},
        stage=3,
        resume=True,
    ),
    Row(
        "exc_step",
        "exception on rank 1 in step (step 3, ZeRO-1)",
        {"point": "step", "rank": 1, "step": 3},
        stage=1,
        resume=True,
    ),
    Row(
        "exc_save",
        "exception on rank 1 in save_checkpoint (step 4, ZeRO-2)",
        {"point": "save", "rank": 1, "step": 4},
        resume=True,
    ),
    Row(
        "exc_load",
        "exception on rank 1 in load_checkpoint (step 5, ZeRO-3)",
        {"point": "load", "rank": 1, "step": 5},
        stage=3,
        resume=True,
    ),
    Row("exc_initialize", "exception on rank 1 in initialize (ZeRO-2)", {"point": "initialize", "rank": 1, "step": 0}),
    Row(
        "exc_user",
        "exception on rank 1 in user code between engine calls (step 3, ZeRO-0)",
        {"point": "user", "rank": 1, "step": 3},
        stage=0,
        resume=True,
    ),
    Row(
        "exc_forward_caught",
        "exception on rank 1 in forward, caught by the loop (skip the batch; step 3, ZeRO-2)",
        {"point": "forward", "kind": "caught", "rank": 1, "step": 3},
    ),
    Row(
        "collective_mismatch",
        "collective mismatch: rank 1 alone calls save_checkpoint (step 3, ZeRO-2, verify_collective_order)",
        {"point": "mismatch", "rank": 1, "step": 3},
        config={"fault_tolerance": {"verify_collective_order": True}},
        resume=True,
    ),
    Row(
        "kill_step",
        "kill -9 of rank 1 mid-step (step 5, ZeRO-2)",
        {"point": "step", "kind": "kill", "rank": 1, "step": 5},
        resume=True,
    ),
    Row(
        "kill_backward",
        "kill -9 of rank 1 mid-backward (step 5, ZeRO-3)",
        {"point": "backward", "kind": "kill", "rank": 1, "step": 5},
        stage=3,
        resume=True,
    ),
    Row(
        "kill_save",
        "kill -9 of rank 0 mid-save (step 4, ZeRO-2)",
        {"point": "save", "kind": "kill", "rank": 0, "step": 4},
        resume=True,
    ),
    Row(
        "sigterm_launcher",
        "SIGTERM to the launcher at step 5 (save_on_preemption, no periodic saves; resume: auto_resume)",
        {"point": "preempt", "rank": 0, "step": 5},
        save_every=1000,
        config={"fault_tolerance": {"save_on_preemption": True, "checkpoint_dir": "{row}/ckpt"}},
        resume=True,
        sigterm_launcher=True,
    ),
    Row(
        "enospc_save",
        "ENOSPC on rank 1 in save_checkpoint (step 4, ZeRO-2)",
        _inject("inject", 1, 4, "checkpoint_write:enospc:rank=1"),
        resume=True,
    ),
    Row(
        "enospc_offload_setup",
        "ENOSPC on rank 1 creating the NVMe swap files (initialize, ZeRO-2 offload_optimizer nvme)",
        _inject("inject", 1, 0, "offload_setup:enospc:rank=1"),
        config=_NVME,
    ),
    Row(
        "enospc_offload_write",
        "ENOSPC on rank 1 writing NVMe offload (step 3, ZeRO-2 offload_optimizer nvme)",
        _inject("inject", 1, 3, "offload_write:enospc:rank=1"),
        config=_NVME,
        resume=True,
    ),
    Row(
        "corrupt_byte",
        "one byte flipped in the latest checkpoint (rank 1's file), then resume",
        {"point": "resume_load", "step": 0},
        damage="corrupt",
    ),
    Row(
        "truncated_file",
        "the latest checkpoint's rank 1 file truncated to half, then resume",
        {"point": "resume_load", "step": 0},
        damage="truncate",
    ),
    Row(
        "nan_input",
        "NaN in rank 1's input at step 3 (fp32, gradient_clipping 1.0, ZeRO-2)",
        {"point": "nan", "rank": 1, "step": 3},
    ),
    Row(
        "fp16_storm",
        "fp16 overflow storm: rank 1's loss x 1e30 from step 3 (min_loss_scale 1, patience 3, ZeRO-2)",
        {"point": "fp16_storm", "rank": 1, "step": 3},
        precision="fp16",
        steps=16,
        config={"fault_tolerance": {"min_loss_scale_patience": 3}},
    ),
)
ROWS_BY_NAME = {row.name: row for row in ROWS}


def _fill(value: Any, row_dir: Path) -> Any:
    """``{row}`` in config strings → the row's directory."""
    if isinstance(value, dict):
        return {key: _fill(item, row_dir) for key, item in value.items()}
    if isinstance(value, str):
        return value.replace("{row}", str(row_dir))
    return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def make_spec(row: Row, row_dir: Path, *, fault: bool, auto_resume: bool = False) -> dict[str, Any]:
    """The script's spec for one launch of ``row`` (``fault=False``: the baseline or the resume launch)."""
    config = _merge({"fault_tolerance": {"collective_timeout_s": COLLECTIVE_TIMEOUT_S}}, _fill(row.config, row_dir))
    if auto_resume:
        config = _merge(config, {"fault_tolerance": {"auto_resume": True, "checkpoint_dir": str(row_dir / "ckpt")}})
    return {
        "stage": row.stage,
        "precision": row.precision,
        "steps": row.steps,
        "save_every": row.save_every,
        "checkpoint_dir": str(row_dir / "ckpt"),
        "config": config,
        "fault": row.fault if fault else None,
    }


def baseline_key(row: Row) -> str:
    """Runs that must give the same final parameters when nothing goes wrong share one baseline."""
    numerics = {k: v for k, v in row.config.items() if k != "fault_tolerance"}
    return json.dumps([row.stage, row.precision, row.steps, numerics], sort_keys=True)


# -------------------------------------------------------------------------------------------- processes


def become_subreaper() -> bool:
    """Make this process the subreaper of everything it starts (Linux): a rank whose parent (torchrun) died is
    re-parented here instead of to init, so the harness can still find, count and kill it.

    [Note: subreaper] torchrun starts each rank in a new session, so killing the launcher's process group misses
    the ranks, and an orphan re-parented to init could not be told from other users' processes. This is a
    process-wide setting on purpose: the harness is a standalone program that owns every process it starts."""
    if not sys.platform.startswith("linux"):
        return False
    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def _sigterm_when_parent_dies() -> None:
    """In the launcher's process before exec: SIGTERM it if the harness dies (killed by a test's timeout, say),
    which makes the launcher stop torchrun and its ranks instead of leaving the job running unwatched."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _parent_map() -> dict[int, int]:
    """pid → parent pid of every process visible in /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2:
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first), zombies included."""
    parents = _parent_map()
    found: list[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _reap(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _alive(pid: int) -> bool:
    """Running (not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Launch:
    """What one launched job did."""

    exit_code: int | None
    """The launcher's exit code (None: killed on timeout)."""
    timed_out: bool
    started: float
    ended: float
    """Wall-clock time the last process of the job exited (or was killed)."""
    orphans: int
    """Processes still alive ORPHAN_GRACE_S after the launcher exited (killed by the harness)."""
    launcher_stderr: str
    rank_logs: dict[int, str]
    sigterm_sent: float | None = None


def _child_env() -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(REPO_SRC), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    env.pop("SHARDSPEED_INJECT", None)  # faults come from the spec only
    return env


def launch(
    spec_path: Path,
    run_dir: Path,
    *,
    resume: bool,
    timeout_s: float,
    sigterm_on_marker: bool = False,
) -> Launch:
    """Launch the script on NPROC ranks through the shardspeed launcher; never waits past ``timeout_s``."""
    for attempt in range(3):
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        result = _launch_once(spec_path, run_dir, resume=resume, timeout_s=timeout_s, sigterm=sigterm_on_marker)
        if result.exit_code == 0 or PORT_TAKEN_SIGNATURE not in result.launcher_stderr or attempt == 2:
            return result
    raise AssertionError("unreachable")


def _launch_once(spec_path: Path, run_dir: Path, *, resume: bool, timeout_s: float, sigterm: bool) -> Launch:
    log_dir = run_dir / "logs"
    command = [sys.executable, "-m", "shardspeed.launcher.cli", "--num_procs", str(NPROC)]
    command += ["--master_port", str(_free_port()), "--enable_each_rank_log", str(log_dir)]
    command += [str(SCRIPT), "--spec", str(spec_path), "--rundir", str(run_dir), *(["--resume"] if resume else [])]
    stderr_path = run_dir / "launcher.log"
    started = time.time()
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            command,
            cwd=run_dir,
            env=_child_env(),
            stdout=stderr,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_sigterm_when_parent_dies if sys.platform.startswith("linux") else None,
        )
    deadline = time.monotonic() + timeout_s
    timed_out, sigterm_sent = False, None
    family: list[int] = []
    while process.poll() is None:
        family = sorted(set(family) | set(descendants(process.pid)))
        if sigterm and sigterm_sent is None and (run_dir / "fault.json").exists():
            process.send_signal(signal.SIGTERM)
            sigterm_sent = time.time()
        if time.monotonic() > deadline:
            timed_out = True
            _kill_all([process.pid, *descendants(process.pid)])
            process.wait()
            break
        time.sleep(0.2)
    ended = time.time()
    # Whatever of the job is still alive now hangs on after its launcher: wait a little, then kill and count it.
    me = os.getpid()
    leftovers = [pid for pid in descendants(me) if pid in family or _parent_map().get(pid) == me]
    grace_end = time.monotonic() + (0 if timed_out else ORPHAN_GRACE_S)
    while any(_alive(pid) for pid in leftovers) and time.monotonic() < grace_end:
        time.sleep(0.1)
        _reap(leftovers)
        ended = time.time()
    orphans = [pid for pid in leftovers if _alive(pid)]
    _kill_all(orphans)
    _reap(leftovers)
    if orphans:
        ended = time.time()
    return Launch(
        exit_code=None if timed_out else process.returncode,
        timed_out=timed_out,
        started=started,
        ended=ended,
        orphans=len(orphans) if not timed_out else 0,
        launcher_stderr=stderr_path.read_text(errors="replace"),
        rank_logs=read_rank_logs(log_dir),
        sigterm_sent=sigterm_sent,
    )


def read_rank_logs(log_dir: Path) -> dict[int, str]:
    """``<prefix>_rank<R>.log`` → {R: text} (the launcher's ``--enable_each_rank_log`` files)."""
    logs: dict[int, str] = {}
    for path in sorted(log_dir.glob("*_rank*.log")) if log_dir.is_dir() else []:
        match = re.search(r"_rank(\d+)\.log$", path.name)
        if match:
            logs[int(match.group(1))] = path.read_text(errors="replace")
    return logs


# ------------------------------------------------------------------------------------------------ reading

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


def describe_checkpoints(ckpt: Path) -> str:
    """``latest``, committed tags, in-progress / replaced leftovers, files in an NVMe swap directory."""
    if not ckpt.is_dir():
        return "no checkpoint dir"
    latest_file = ckpt / "latest"
    latest = latest_file.read_text().strip() if latest_file.exists() else None
    entries = sorted(ckpt.iterdir())
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


def verify_latest(spec_path: Path, ckpt: Path, timeout_s: float = VERIFY_TIMEOUT_S) -> dict[str, Any]:
    """Load the latest checkpoint in a fresh world of one (its own free port); the script's JSON verdict."""
    if not (ckpt / "latest").exists():
        return {"loads": False, "error": "no latest"}
    env = {**_child_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    command = [sys.executable, str(SCRIPT), "--spec", str(spec_path), "--verify", str(ckpt)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"loads": False, "error": f"TIMEOUT (hang) loading after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("FAULT_TABLE_VERIFY "):
            return json.loads(line.removeprefix("FAULT_TABLE_VERIFY "))
    return {"loads": False, "error": f"verify exited {done.returncode}: {last_error_line(done.stderr)}"}


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


# ------------------------------------------------------------------------------------------------- damage


def _rank_file(tag_dir: Path, rank: int) -> Path:
    """The data file ``rank`` wrote (``rank00001-000.safetensors``), else the first data file."""
    files = sorted(tag_dir.glob("*.safetensors"))
    mine = [path for path in files if re.match(rf"rank0*{rank}-", path.name)]
    if not files:
        raise FileNotFoundError(f"no safetensors file in {tag_dir}")
    return (mine or files)[0]


def corrupt_byte(path: Path) -> str:
    """Flip one byte in the middle of a safetensors file's tensor data (past its JSON header)."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    offset = 8 + header + (len(data) - 8 - header) // 2
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"flipped byte {offset} of {path.name}"


def truncate_half(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    return f"truncated {path.name} from {size} to {size // 2} bytes"


DAMAGE: dict[str, Callable[[Path], str]] = {"corrupt": corrupt_byte, "truncate": truncate_half}


# ------------------------------------------------------------------------------------------------ results


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


# ---------------------------------------------------------------------------------------------- the runner


class TableRunner:
    """Runs rows (and the baselines they need) under one work directory."""

    def __init__(self, workdir: Path, timeout_s: float, log: Callable[[str], None] = print) -> None:
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.log = log
        self.baselines: dict[str, Path] = {}

    def baseline(self, row: Row) -> Path | None:
        """The uninterrupted run's directory for ``row``'s numerics (run once); None if it failed."""
        key = baseline_key(row)
        if key not in self.baselines:
            base_dir = self.workdir / f"baseline-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
            base_dir.mkdir(parents=True, exist_ok=True)
            spec_path = base_dir / "spec.json"
            config = {k: v for k, v in row.config.items() if k != "fault_tolerance"}
            plain = replace(row, config=config, save_every=2)  # the damage rows copy its checkpoints
            spec_text = json.dumps(make_spec(plain, base_dir, fault=False), indent=1)
            # A finished baseline of the same spec in a reused --workdir is kept (reruns of a few rows).
            if not (
                spec_path.exists() and spec_path.read_text() == spec_text and (base_dir / "run/done.json").exists()
            ):
                spec_path.write_text(spec_text)
                self.log(f"[fault_table] baseline for {row.name}: {base_dir}")
                job = launch(spec_path, base_dir / "run", resume=False, timeout_s=self.timeout_s)
                if job.exit_code != 0 or not (base_dir / "run" / "final.pt").exists():
                    self.log(f"[fault_table] baseline FAILED ({describe_exit(job)}); see {base_dir}")
            self.baselines[key] = base_dir
        base_dir = self.baselines[key]
        return base_dir if (base_dir / "run" / "final.pt").exists() else None

    def run_row(self, row: Row) -> RowResult:
        row_dir = self.workdir / row.name
        if row_dir.exists():
            shutil.rmtree(row_dir)
        row_dir.mkdir(parents=True)
        notes: list[str] = []
        spec_path = row_dir / "spec.json"
        spec_path.write_text(json.dumps(make_spec(row, row_dir, fault=True), indent=1))
        base = self.baseline(row) if (row.resume or row.damage or row.fault is not None) else None
        if row.damage:
            if base is None:
                return self._harness_failure(row, "the baseline run failed, nothing to damage")
            shutil.copytree(base / "ckpt", row_dir / "ckpt")
            tag = (row_dir / "ckpt" / "latest").read_text().strip()
            notes.append(DAMAGE[row.damage](_rank_file(row_dir / "ckpt" / tag, 1)) + f" (tag {tag})")
        self.log(f"[fault_table] {row.name}: launching ({row_dir})")
        job = launch(
            spec_path,
            row_dir / "run",
            resume=row.damage is not None,
            timeout_s=self.timeout_s,
            sigterm_on_marker=row.sigterm_launcher,
        )
        fault_time = job.sigterm_sent if row.sigterm_launcher else _fault_time(row_dir / "run")
        printed = {rank: last_error_line(job.rank_logs.get(rank, "")) for rank in range(NPROC)}
        for rank, code in rank_exit_codes(job.launcher_stderr).items():
            printed[rank] = f"[{code}] {printed.get(rank, '')}"
        launcher = describe_exit(job)
        launcher_line = launcher_summary(job.launcher_stderr)
        if launcher_line:
            launcher += f": {launcher_line}"
        on_disk = describe_checkpoints(row_dir / "ckpt")
        on_disk += "; " + describe_verify(verify_latest(spec_path, row_dir / "ckpt"))
        nvme = row_dir / "nvme"
        if nvme.is_dir():
            on_disk += f"; nvme dir: {sum(1 for _ in nvme.rglob('*') if _.is_file())} file(s)"
        resume = self._resume(row, row_dir, base, job)
        return RowResult(
            row.name,
            row.title,
            printed,
            launcher,
            time_to_exit(job, fault_time, self.timeout_s),
            on_disk,
            resume,
            notes,
        )

    def _resume(self, row: Row, row_dir: Path, base: Path | None, job: Launch) -> str:
        final = row_dir / "run" / "final.pt"
        if not row.resume:
            if final.exists() and base is not None:
                done = json.loads((row_dir / "run" / "done.json").read_text())
                diff = max_abs_diff(final, base / "run" / "final.pt")
                finite = "finite" if done.get("finite") else "NOT finite"
                return (
                    f"n/a; run finished: params {finite}, skipped steps {done.get('skipped_steps')}, "
                    f"max abs diff vs uninterrupted {diff:.2e}"
                )
            return "n/a"
        if base is None:
            return "no baseline (uninterrupted run failed)"
        if job.exit_code == 0 and final.exists():
            diff = max_abs_diff(final, base / "run" / "final.pt")
            return f"not needed: the job finished (exit 0); max abs diff vs uninterrupted {diff:.2e}"
        auto = row.sigterm_launcher
        spec_path = row_dir / "spec-resume.json"
        spec_path.write_text(json.dumps(make_spec(row, row_dir, fault=False, auto_resume=auto), indent=1))
        self.log(f"[fault_table] {row.name}: resuming")
        again = launch(spec_path, row_dir / "resume", resume=not auto, timeout_s=self.timeout_s)
        how = "auto_resume" if auto else "load_checkpoint(latest)"
        if again.exit_code != 0 or not (row_dir / "resume" / "final.pt").exists():
            lines = "; ".join(f"r{r}: {last_error_line(t)}" for r, t in sorted(again.rank_logs.items()))
            return f"resume ({how}) failed: {describe_exit(again)}; {lines}"
        start = json.loads((row_dir / "resume" / "start.json").read_text())["start_step"]
        diff = max_abs_diff(row_dir / "resume" / "final.pt", base / "run" / "final.pt")
        if not start:  # a full rerun: equal parameters would prove nothing about resuming
            return f"NOT resumed ({how}: restarted from step 0); max abs diff vs uninterrupted {diff:.2e}"
        verdict = "reproduced" if diff <= EQUAL_TOLERANCE else "DIFFERS"
        return f"{verdict} ({how}, resumed at step {start}): max abs diff {diff:.2e}"

    def _harness_failure(self, row: Row, why: str) -> RowResult:
        return RowResult(row.name, row.title, {}, "not run", "-", "-", "-", [f"harness: {why}"])


def _fault_time(run_dir: Path) -> float | None:
    marker = run_dir / "fault.json"
    return json.loads(marker.read_text())["time"] if marker.exists() else None


def launcher_summary(text: str) -> str:
    """The launcher's own "[shardspeed] ..." verdict line, and the rank torchrun names as the root cause."""
    lines = [line.strip() for line in text.splitlines() if line.startswith("[shardspeed]")]
    verdicts = [line for line in lines if "exited" in line or "interrupted" in line or "failed" in line]
    summary = trim(verdicts[-1], 120) if verdicts else ""
    _, found, after = text.partition("Root Cause (first observed failure)")
    root = _TORCHRUN_FAILURE.search(after) if found else None
    if root is not None:
        summary += f" (torchrun: first failure rank {root.group(1)})"
    return summary.strip()


def select_rows(names: str | None) -> list[Row]:
    if not names:
        return list(ROWS)
    chosen = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in ROWS_BY_NAME:
            raise SystemExit(f"fault_table: unknown row {name!r}; rows: {', '.join(ROWS_BY_NAME)}")
        chosen.append(ROWS_BY_NAME[name])
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all; --list shows them)")
    parser.add_argument("--out", help="write the Markdown table here (it is printed either way)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per launch (default %(default)s)"
    )
    parser.add_argument("--workdir", help="where rows keep logs and checkpoints (default: a new temporary dir, kept)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    args = parser.parse_args(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.name:<22} {row.title}")
        return 0
    rows = select_rows(args.rows)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault-table-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if not become_subreaper():
        print("[fault_table] not Linux: orphans cannot be tracked", file=sys.stderr)
    runner = TableRunner(workdir, args.timeout, log=lambda line: print(line, file=sys.stderr, flush=True))
    results = []
    started = time.monotonic()
    for row in rows:
        results.append(runner.run_row(row))
        print(render_table(results[-1:]).splitlines()[2], file=sys.stderr, flush=True)
    table = render_table(results)
    footer = f"\n{len(rows)} row(s) in {time.monotonic() - started:.0f} s; work directory: {workdir}\n"
    if args.out:
        Path(args.out).write_text(table)
    print(table + footer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
