"""Launching one fault-table job and accounting for every process it started (timeouts, orphans)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fault_report import last_error_line
from launch_util import child_env, free_port

BENCH_DIR = Path(__file__).resolve().parent
SCRIPT = BENCH_DIR / "fault_table_script.py"
NPROC = 2
VERIFY_TIMEOUT_S = 120.0
ORPHAN_GRACE_S = 10.0
PORT_TAKEN_SIGNATURE = "EADDRINUSE"


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
    return child_env(cpu_only=False, force_one_thread=True, unset=["SHARDSPEED_INJECT"])  # faults: the spec only


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
    command += ["--master_port", str(free_port()), "--enable_each_rank_log", str(log_dir)]
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


def verify_latest(spec_path: Path, ckpt: Path, timeout_s: float = VERIFY_TIMEOUT_S) -> dict[str, Any]:
    """Load the latest checkpoint in a fresh world of one (its own free port); the script's JSON verdict."""
    if not (ckpt / "latest").exists():
        return {"loads": False, "error": "no latest"}
    env = {**_child_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = [sys.executable, str(SCRIPT), "--spec", str(spec_path), "--verify", str(ckpt)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"loads": False, "error": f"TIMEOUT (hang) loading after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("FAULT_TABLE_VERIFY "):
            return json.loads(line.removeprefix("FAULT_TABLE_VERIFY "))
    return {"loads": False, "error": f"verify exited {done.returncode}: {last_error_line(done.stderr)}"}
