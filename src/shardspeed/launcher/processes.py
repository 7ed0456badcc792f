"""Run the launch commands (one torchrun, or one ssh/pdsh per node) and turn their fates into one exit code.

Rules: wait for all; the first command to fail decides the exit code and the others are terminated (a job
missing one node would otherwise hang in its next collective); Ctrl-C terminates everything and returns 130,
SIGTERM to the launcher (a batch scheduler cancelling the job) the same and returns 143.
Termination is SIGTERM, then SIGKILL after a grace period: torchrun answers SIGTERM by stopping its workers,
which it needs a moment for. The grace (``GRACE_S``) outlasts torchrun's own (30 s from SIGTERM to SIGKILL of its
workers): torchrun's workers run in sessions of their own, so a torchrun killed before it killed them would leave
them running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_POLL_INTERVAL_S = 0.05
EXIT_CODE_INTERRUPTED = 128 + signal.SIGINT
EXIT_CODE_TERMINATED = 128 + signal.SIGTERM
GRACE_S = 45.0


class _LauncherTerminated(Exception):
    """Raised in the main thread when the launcher itself receives SIGTERM."""


def _raise_terminated(_signal_number: int, _frame: object) -> None:
    raise _LauncherTerminated


@dataclass(frozen=True, kw_only=True)
class LaunchCommand:
    """One local process the launcher starts."""

    name: str
    """What the command is, for messages (e.g. "node 1 (worker-2)")."""
    argv: list[str]
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    """Added to the launcher's environment for this process."""
    hold_stdin: bool = False
    """Give the process a pipe as stdin and keep it open until the process ends: its closing is the signal
    (through ssh) for the remote side to stop. Otherwise stdin is inherited."""


def exit_code_of(returncode: int) -> int:
    """Shell convention for a process killed by a signal: 128 + signal number (Popen reports -signal)."""
    return 128 - returncode if returncode < 0 else returncode


def _start(command: LaunchCommand) -> subprocess.Popen[bytes]:
    env = {**os.environ, **command.env_overrides} if command.env_overrides else None
    stdin = subprocess.PIPE if command.hold_stdin else None
    return subprocess.Popen(command.argv, env=env, stdin=stdin)


def _terminate(processes: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` for all, then SIGKILL the stragglers."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
        if process.stdin is not None:
            process.stdin.close()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_commands(commands: Sequence[LaunchCommand], grace_s: float = GRACE_S) -> int:
    """Start ``commands`` together and wait; return 0, the first failure's exit code, 130 on Ctrl-C or 143
    when the launcher receives SIGTERM."""
    processes: list[subprocess.Popen[bytes]] = []
    # Without this, SIGTERM would kill the launcher at once and orphan a local torchrun. Signal handlers can
    # only be installed from the main thread; elsewhere (embedding code) the default behaviour stays.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm_handler = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        for command in commands:
            processes.append(_start(command))
        while True:
            # One poll per process per sweep, so a process that ends mid-sweep cannot be both "not failed"
            # and "finished" without its exit code being looked at.
            returncodes = [process.poll() for process in processes]
            for command, returncode in zip(commands, returncodes):
                if returncode is not None and returncode != 0:
                    print(
                        f"[shardspeed] {command.name} exited with code {exit_code_of(returncode)}; stopping the others",
                        file=sys.stderr,
                    )
                    _terminate(processes, grace_s)
                    return exit_code_of(returncode)
            if all(returncode is not None for returncode in returncodes):
                return 0
            time.sleep(_POLL_INTERVAL_S)
    except (KeyboardInterrupt, _LauncherTerminated) as interruption:
        print("[shardspeed] interrupted; stopping all processes", file=sys.stderr)
        _terminate(processes, grace_s)
        return EXIT_CODE_INTERRUPTED if isinstance(interruption, KeyboardInterrupt) else EXIT_CODE_TERMINATED
    except BaseException:
        _terminate(processes, grace_s)
        raise
    finally:
        if previous_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, previous_sigterm_handler)
        for process in processes:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
