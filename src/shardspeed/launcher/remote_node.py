"""What ssh runs on each node: torchrun, stopped when the launcher goes away.

``python <path>/remote_node.py <torchrun args>`` runs torchrun (through ``torchrun_agent.py``) and waits.
Without a tty, sshd does not signal a remote command when the client side dies, so a killed launcher (or a
failure on another node) would leave this node's ranks running and holding their devices. The launcher keeps
the ssh client's stdin open for the job's lifetime, so EOF on our stdin means "the launcher is gone or wants
us to stop": we then SIGTERM torchrun, which stops its workers. SIGTERM/SIGINT/SIGHUP sent to this process are
forwarded the same way.

stdin is only watched when it is a pipe or socket (what ssh provides); run by hand with a terminal or
/dev/null as stdin, this is just torchrun.

``SHARDSPEED_FAILURE_DIR`` names a directory on the launcher's machine. When it does not exist here (a real
remote node) it is created for this node's ranks, this node's first failure is printed after a failed run (ssh
carries the line back to the launcher) and the directory is removed; when it exists (the "nodes" share the
launcher's machine) the launcher reads and removes it.

Self-contained on purpose (standard library only, run by file path rather than ``-m``): importing the
``shardspeed`` package would import torch, and a supervisor on every node should start instantly and not
depend on the package's import-time behaviour.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading

if __package__:
    from shardspeed.launcher.failure_report import FAILURE_DIR_ENV, report_lines
else:  # run by file path (as ssh runs it): the sibling module, standard library only
    from failure_report import FAILURE_DIR_ENV, report_lines  # type: ignore[no-redef]

AGENT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_agent.py")

# Longer than torchrun's own 30 s from SIGTERM to SIGKILL of its workers (their own sessions: torchrun must be
# alive to kill them).
_KILL_AFTER_S = 45.0


def _stdin_is_a_connection() -> bool:
    """True when stdin is a pipe or socket — i.e. its EOF means the other end (the launcher) closed it."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _stop(torchrun: subprocess.Popen[bytes], signal_number: int) -> None:
    """Forward ``signal_number`` to torchrun; SIGKILL it if it has not stopped after a grace period."""
    if torchrun.poll() is not None:
        return
    torchrun.send_signal(signal_number)
    killer = threading.Timer(_KILL_AFTER_S, lambda: torchrun.poll() is None and torchrun.kill())
    killer.daemon = True
    killer.start()


def _stop_on_stdin_eof(torchrun: subprocess.Popen[bytes]) -> None:
    """Block until stdin reaches EOF (or fails), then stop torchrun. Runs in a daemon thread."""
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except OSError:
        pass
    _stop(torchrun, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments) under the stdin / signal watch."""
    torchrun_arguments = sys.argv[1:] if argv is None else argv
    failure_dir = os.environ.get(FAILURE_DIR_ENV)
    own_failure_dir = bool(failure_dir) and not os.path.isdir(str(failure_dir))
    if own_failure_dir:
        os.makedirs(str(failure_dir), exist_ok=True)
    try:
        returncode = _run(torchrun_arguments)
        if returncode != 0 and own_failure_dir:
            for line in report_lines(str(failure_dir), where="this node"):
                print(line, file=sys.stderr, flush=True)
        return returncode
    finally:
        if own_failure_dir:
            shutil.rmtree(str(failure_dir), ignore_errors=True)


def _run(torchrun_arguments: list[str]) -> int:
    torchrun = subprocess.Popen([sys.executable, "-u", AGENT_SCRIPT, *torchrun_arguments], stdin=subprocess.DEVNULL)
    for signal_number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signal_number, lambda number, _frame: _stop(torchrun, number))
    if _stdin_is_a_connection():
        threading.Thread(target=_stop_on_stdin_eof, args=(torchrun,), daemon=True).start()
    returncode = torchrun.wait()
    return 128 - returncode if returncode < 0 else returncode  # killed by a signal: shell's 128 + signal


if __name__ == "__main__":
    sys.exit(main())
