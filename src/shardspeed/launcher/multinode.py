"""Multi-node launch: one torchrun per host, started through ssh or pdsh.

The command each host runs is built as an argv list and turned into one shell string with ``shlex.join``
(every word single-quoted as needed), because ssh hands its command to the remote login shell. Host names were
validated by the hostfile parser, and no script argument, path or environment value is ever pasted into the
string unquoted, so none of them can inject shell code.

Per host the remote shell runs::

    cd <launcher cwd> && exec env K=V ... <python> -u <install dir>/launcher/remote_node.py <torchrun args>

Environment: the remote login shell does not see the launcher's environment, so the variables a job depends on
are passed explicitly (``env K=V``): PYTHONPATH, OMP_NUM_THREADS, everything starting with NCCL_ / GLOO_ /
TORCH_ / TORCHELASTIC_ / SHARDSPEED_ (among them the launch's ``SHARDSPEED_FAILURE_DIR``), and
CUDA_VISIBLE_DEVICES when ``--include``/``--exclude`` chose specific device slots.
The remote python is the launcher's own ``sys.executable`` and ``remote_node.py`` is found at this
installation's path: like DeepSpeed, we assume the same environment is installed at the same path on every
node.

DeepSpeed's ``--launcher_args`` (extra words for ssh/pdsh, split like a shell), ``--ssh_port`` (ssh ``-p``; under
pdsh through ``PDSH_SSH_ARGS_APPEND``, as DeepSpeed does) and ``--venv_script`` (sourced by the remote shell before
the ``exec``) arrive as one ``RemoteShell``.

Each node runs torchrun through ``torchrun_agent.py`` (failure records for ranks killed by a signal).

Why ``remote_node`` under ssh: killing a local ssh client does not stop what it started remotely (without a
tty nothing signals the remote side). ``remote_node`` runs torchrun and stops it when its stdin — the ssh
connection, which the launcher holds open — reaches EOF, so a failure elsewhere or Ctrl-C stops every node.
pdsh does not forward stdin, so under pdsh torchrun is run directly and remote cleanup is pdsh's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.hostfile import unbracketed
from shardspeed.launcher.processes import LaunchCommand
from shardspeed.launcher.resources import ResourcePool
from shardspeed.launcher.torchrun import AGENT_SCRIPT, Rendezvous, torchrun_args

EXPORTED_ENV_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS")
EXPORTED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "SHARDSPEED_")
REMOTE_NODE_SCRIPT = str(Path(__file__).resolve().with_name("remote_node.py"))
LAUNCHER_CHOICES = ("auto", "ssh", "pdsh")
# BatchMode: fail instead of prompting for a password, which several nodes at once cannot answer.
SSH_OPTIONS = ("-o", "BatchMode=yes")


@dataclass(frozen=True)
class RemoteShell:
    """How the remote shell is reached and prepared: extra ssh/pdsh words, ssh port, a script to source."""

    extra_args: list[str] = field(default_factory=list)
    ssh_port: int | None = None
    venv_script: str | None = None

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> RemoteShell:
        try:
            extra = shlex.split(options.launcher_args or "")
        except ValueError as error:
            raise LauncherError(f"--launcher_args {options.launcher_args!r}: {error}") from None
        if options.ssh_port is not None and not 1 <= options.ssh_port <= 65535:
            raise LauncherError(f"--ssh_port {options.ssh_port}: must be a TCP port in 1..65535")
        return cls(extra_args=extra, ssh_port=options.ssh_port, venv_script=options.venv_script or None)


def exported_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the launcher's environment every node should see (sorted, for stable commands)."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name in EXPORTED_ENV_NAMES or name.startswith(EXPORTED_ENV_PREFIXES)
    }


def choose_launcher(requested: str, which: Callable[[str], str | None] = shutil.which) -> str:
    """``ssh`` or ``pdsh``. ``auto`` picks pdsh when it is on PATH (DeepSpeed's default) and ssh otherwise."""
    if requested not in LAUNCHER_CHOICES:
        raise LauncherError(f"--launcher {requested!r}: expected one of {', '.join(LAUNCHER_CHOICES)}")
    if requested == "auto":
        return "pdsh" if which("pdsh") else "ssh"
    if which(requested) is None:
        raise LauncherError(f"--launcher {requested}: {requested!r} was not found on PATH")
    return requested


def remote_shell_command(cwd: str, env: Mapping[str, str], argv: Sequence[str], source: str | None = None) -> str:
    """One shell string: cd into ``cwd``, source ``source`` if given, then exec ``argv`` with ``env`` added; every
    word shell-quoted."""
    env_words = [f"{name}={value}" for name, value in env.items()]
    prepare = f" && . {shlex.quote(source)}" if source else ""
    return f"cd {shlex.quote(cwd)}{prepare} && exec {shlex.join(['env', *env_words, *argv])}"


def node_commands(
    pool: ResourcePool,
    *,
    launcher: str,
    rendezvous: Rendezvous,
    script: str,
    script_args: Sequence[str],
    set_visible_devices: bool,
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    python: str = sys.executable,
    remote: RemoteShell | None = None,
    max_restarts: int = 0,
) -> list[LaunchCommand]:
    """The local commands (ssh/pdsh invocations) that start node ``i`` of the job on host ``i`` of ``pool``.

    ``set_visible_devices`` passes each host its selected slots as CUDA_VISIBLE_DEVICES (used when
    ``--include``/``--exclude`` picked specific devices).
    """
    remote = RemoteShell() if remote is None else remote
    base_env = exported_env(os.environ if environ is None else environ)
    work_dir = os.getcwd() if cwd is None else cwd
    commands = []
    for node_rank, (host, slots) in enumerate(pool.items()):
        env = dict(base_env)
        if set_visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(slot) for slot in slots)
        arguments = torchrun_args(
            nnodes=len(pool),
            node_rank=node_rank,
            nproc_per_node=len(slots),
            rendezvous=rendezvous,
            script=script,
            script_args=script_args,
            max_restarts=max_restarts,
        )
        env_overrides: dict[str, str] = {}
        if launcher == "ssh":
            remote_argv = [python, "-u", REMOTE_NODE_SCRIPT, *arguments]
            shell = remote_shell_command(work_dir, env, remote_argv, remote.venv_script)
            port = ["-p", str(remote.ssh_port)] if remote.ssh_port is not None else []
            local_argv = ["ssh", *SSH_OPTIONS, *port, *remote.extra_args, unbracketed(host), shell]
        elif launcher == "pdsh":
            remote_argv = [python, "-u", AGENT_SCRIPT, *arguments]
            shell = remote_shell_command(work_dir, env, remote_argv, remote.venv_script)
            # One pdsh per host (not one fan-out call) because each node needs its own node rank, process
            # count and device list; -S returns the remote exit status, -R ssh avoids pdsh's rsh default.
            local_argv = ["pdsh", "-S", "-R", "ssh", *remote.extra_args, "-w", unbracketed(host), shell]
            if remote.ssh_port is not None:  # pdsh's ssh module appends this to every ssh it runs
                env_overrides["PDSH_SSH_ARGS_APPEND"] = f"-p {remote.ssh_port}"
        else:
            raise LauncherError(f"--launcher {launcher!r}: expected ssh or pdsh for a multi-node launch")
        commands.append(
            LaunchCommand(
                name=f"node {node_rank} ({host})", argv=local_argv, env_overrides=env_overrides, hold_stdin=True
            )
        )
    return commands
