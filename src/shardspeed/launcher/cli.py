"""The ``shardspeed`` command: DeepSpeed's launcher on top of ``torch.distributed.run``, plus subcommands.

Dispatch rule: if the first command-line word is a registered subcommand name (see ``subcommands.py``;
``shardspeed help`` lists them), the remaining words go to that subcommand. Otherwise the command line is a
launch::

    shardspeed [launcher options] script.py [script args...]

Launcher options come before the script; the first word that is not a launcher option (or the word after
``--``) is the script, and everything after it is passed to the script untouched — even words that look like
launcher options. A script whose file name equals a subcommand name runs as ``./name``, ``-- name``, or with
any launcher option in front.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator, Sequence

from shardspeed.config.errors import did_you_mean
from shardspeed.launcher import failure_report
from shardspeed.launcher.deepspeed_flags import OTHER_LAUNCHERS
from shardspeed.launcher.errors import LauncherError, MissingScriptError
from shardspeed.launcher.multinode import LAUNCHER_CHOICES
from shardspeed.launcher.plan import DEFAULT_HOSTFILE, plan_launch
from shardspeed.launcher.processes import EXIT_CODE_INTERRUPTED, EXIT_CODE_TERMINATED, run_commands
from shardspeed.launcher.subcommands import get_subcommand, subcommands
from shardspeed.launcher.torchrun import DEFAULT_MASTER_PORT, DEFAULT_RDZV_ID, RDZV_BACKENDS

PROGRAM = "shardspeed"

# Launcher options that take a value: needed to find where the script starts before argparse runs (argparse
# alone cannot tell "--foo" meant for the script from a launcher option). build_parser uses the same table.
_VALUE_OPTIONS: dict[tuple[str, ...], dict[str, object]] = {
    ("--num_gpus", "--num_accelerators"): {
        "type": int,
        "dest": "num_gpus",
        "help": "processes (GPUs) per node; default: all CUDA devices, or 1 on CPU",
    },
    ("--num_procs",): {"type": int, "help": "same as --num_gpus, spelled for CPU jobs (no device check)"},
    ("--num_nodes", "--nnodes"): {
        "type": int,
        "dest": "num_nodes",
        "help": "with a hostfile: use its first K hosts; started by hand (--node_rank or --rdzv_backend c10d): "
        "the number of nodes in the job",
    },
    ("-H", "--hostfile"): {
        "help": f"hostfile of 'hostname slots=N' lines (default: {DEFAULT_HOSTFILE} if it exists, else localhost)"
    },
    ("-i", "--include"): {"help": "only these hosts/slots, e.g. 'worker-1@worker-2:0,2'"},
    ("-e", "--exclude"): {"help": "all but these hosts/slots, e.g. 'worker-1:0@worker-3'"},
    ("--master_addr",): {"help": "rendezvous address (default: first host; 127.0.0.1 on one node)"},
    ("--master_port",): {
        "type": int,
        "default": DEFAULT_MASTER_PORT,
        "help": "rendezvous port (default %(default)s)",
    },
    ("--node_rank",): {"type": int, "help": "start only this node's share (each node started by hand)"},
    ("--rdzv_backend",): {
        "choices": list(RDZV_BACKENDS),
        "default": "static",
        "help": "torchrun's rendezvous: static (default; --master_addr/--master_port, fixed node ranks) or c10d "
        "(--rdzv_endpoint; node ranks by arrival; without a hostfile each node runs its own shardspeed with "
        "--num_nodes N; needed for --max_restarts across nodes)",
    },
    ("--rdzv_endpoint",): {"help": "c10d rendezvous HOST:PORT (default: --master_addr:--master_port)"},
    ("--rdzv_id",): {
        "help": f"c10d rendezvous job id: nodes with the same id form one job (default {DEFAULT_RDZV_ID})"
    },
    ("--max_restarts", "--max-restarts"): {
        "type": int,
        "dest": "max_restarts",
        "default": 0,
        "help": "restart a node's whole worker group up to N times when a rank fails (torchrun's elastic agent; "
        "the script resumes from its checkpoint, TORCHELASTIC_RESTART_COUNT = attempt); default 0: a failed rank "
        "fails the job, as in DeepSpeed",
    },
    ("--launcher",): {
        "choices": [*LAUNCHER_CHOICES, *OTHER_LAUNCHERS],
        "type": str.lower,
        "default": "auto",
        "help": "remote shell: auto = pdsh if found (DeepSpeed's MPI/SLURM launchers are refused with the reason)",
    },
    ("--launcher_args",): {"default": "", "help": "extra words for ssh/pdsh (one quoted argument, split like a shell)"},
    ("--ssh_port",): {"type": int, "help": "ssh port of the remote nodes (default: ssh's own, normally 22)"},
    ("--venv_script",): {"help": "script sourced on each remote node before starting (e.g. a venv's bin/activate)"},
    ("--enable_each_rank_log",): {"help": "write each rank's stdout+stderr to DIR/<timestamp>_rank<RANK>.log"},
    ("--bind_core_list",): {
        "help": "cores to divide among a node's ranks, e.g. 0-15,32-47 (with --bind_cores_to_rank)"
    },
    ("--autotuning",): {
        "help": "tune: find the fastest config (its autotuning section; results in results_dir); run: tune, then "
        "train with ds_config_optimal.json"
    },
    ("--device_memory_gb",): {"type": float, "help": "autotuning: device memory budget per rank (CPU: simulated)"},
    ("--host_memory_gb",): {"type": float, "help": "autotuning: host memory budget per node (default: the machine's)"},
    ("--min_elastic_nodes",): {"type": int, "help": "refused: elastic training is not implemented yet"},
    ("--max_elastic_nodes",): {"type": int, "help": "refused: elastic training is not implemented yet"},
    ("--comment",): {"help": "refused: only meaningful for DeepSpeed's SLURM launcher"},
    ("--account",): {"help": "refused: only meaningful for DeepSpeed's SLURM launcher"},
}
_FLAG_OPTIONS: dict[tuple[str, ...], str] = {
    ("--force_multi",): "use ssh/pdsh even for a single host",
    ("--dry_run",): "print the commands that would run, and exit",
    ("--module",): "run the script as a module (python -m SCRIPT)",
    ("--no_python",): "run the script as an executable (no python in front)",
    ("--no_local_rank",): "do not pass --local_rank=N to the script (it is always in the LOCAL_RANK variable)",
    ("--bind_cores_to_rank",): "pin each rank to its share of the node's cores; OMP_NUM_THREADS = that share",
    ("--save_pid",): "write the launcher's pid to <tmpdir>/<pid>.deepspeed while the job runs",
    ("--no_ssh",): "start only this node (needs --node_rank), like --node_rank alone",
    ("--no_ssh_check",): "accepted for DeepSpeed compatibility (no ssh pre-check is made)",
    ("--elastic_training",): "refused: elastic training is not implemented yet",
}


def _epilog() -> str:
    listed = "\n".join(f"  {command.name:<14} {command.summary}" for command in subcommands())
    return (
        "dispatch: if the first word is a subcommand name, the rest goes to that subcommand; otherwise the\n"
        "first non-option word is the training script and every word after it is passed to the script.\n"
        "Run a script named like a subcommand as ./NAME or 'shardspeed -- NAME'.\n\n"
        f"subcommands:\n{listed}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser for launcher options (the script and its arguments are split off before parsing)."""
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        usage=f"{PROGRAM} [launcher options] script.py [script args...]  |  {PROGRAM} SUBCOMMAND [args...]",
        description="Launch a training script on one or many nodes with torch.distributed.run (torchrun).",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for flags, settings in _VALUE_OPTIONS.items():
        parser.add_argument(*flags, **settings)  # type: ignore[arg-type]
    for flags, help_text in _FLAG_OPTIONS.items():
        parser.add_argument(*flags, action="store_true", help=help_text)
    return parser


def value_flags() -> set[str]:
    """The launcher options that take a value (``--include HOSTS``): a command line's walker needs them."""
    return {flag for flags in _VALUE_OPTIONS for flag in flags}


def split_script_args(argv: Sequence[str]) -> tuple[list[str], str | None, list[str]]:
    """Split a launch command line into (launcher options, script or None, script arguments)."""
    takes_value = value_flags()
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            script_index = index + 1
            break
        if not word.startswith("-") or word == "-":
            script_index = index
            break
        index += 2 if word in takes_value else 1  # "--opt=value", "-Hfile" and flags are one word
    else:
        return list(argv), None, []
    launcher_words = list(argv[:index])
    if script_index >= len(argv):
        return launcher_words, None, []
    return launcher_words, argv[script_index], list(argv[script_index + 1 :])


def _glue_values(words: list[str]) -> list[str]:
    """``--opt VALUE`` → ``--opt=VALUE`` for long value options, so a value starting with "-" (``--launcher_args
    "-o X"``, as DeepSpeed's docs write it) is read as the value, not as an unknown option."""
    long_value_flags = {flag for flags in _VALUE_OPTIONS for flag in flags if flag.startswith("--")}
    glued, index = [], 0
    while index < len(words):
        if words[index] in long_value_flags and index + 1 < len(words):
            glued.append(f"{words[index]}={words[index + 1]}")
            index += 2
        else:
            glued.append(words[index])
            index += 1
    return glued


def parse_launch_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a launch command line; ``options.script`` / ``options.script_args`` hold the split-off script."""
    parser = build_parser()
    launcher_words, script, script_args = split_script_args(argv)
    options = parser.parse_args(_glue_values(launcher_words))
    if script is None:
        parser.error("missing the training script (shardspeed [launcher options] script.py [script args...])")
    options.script = script
    options.script_args = script_args
    return options


def help_command(argv: list[str]) -> int:
    """``shardspeed help [SUBCOMMAND]``: the launcher's help, or SUBCOMMAND's own ``--help``."""
    if not argv:
        build_parser().print_help()
        return 0
    subcommand = get_subcommand(argv[0])
    if subcommand is None:
        names = [command.name for command in subcommands()]
        print(f"{PROGRAM} help: unknown subcommand {argv[0]!r}{did_you_mean(argv[0], names)}", file=sys.stderr)
        return 2
    return subcommand.resolve()([*argv[1:], "--help"])


def _launch(argv: list[str]) -> int:
    options = parse_launch_args(argv)
    if options.autotuning:  # tune (trials are launches of their own), then maybe launch with the best config
        from shardspeed.autotuning.command import autotune

        return autotune(options, split_script_args(argv)[0], _launch)
    if options.dry_run:
        return _plan_and_run(options, failure_dir=None)
    with failure_report.failure_dir() as directory:
        return _plan_and_run(options, failure_dir=directory)


def _plan_and_run(options: argparse.Namespace, failure_dir: str | None) -> int:
    try:
        plan = plan_launch(options, failure_dir=failure_dir)
    except MissingScriptError as error:  # maybe a misspelt subcommand: "shardspeed estimat ..."
        suggestion = did_you_mean(options.script, [command.name for command in subcommands()])
        print(f"{PROGRAM}: error: {error}{suggestion}", file=sys.stderr)
        return 2
    except LauncherError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"[{PROGRAM}] {note}", file=sys.stderr)
    for command in plan.commands:
        env_words = [f"{name}={value}" for name, value in command.env_overrides.items()]
        line = f"{command.name}: {shlex.join([*env_words, *command.argv])}"
        print(
            line if options.dry_run else f"[{PROGRAM}] {line}",
            file=sys.stdout if options.dry_run else sys.stderr,
        )
    if options.dry_run or failure_dir is None:
        return 0
    if not options.save_pid:
        code = run_commands(plan.commands)
    else:
        try:
            with pid_file(os.getpid()) as path:
                print(f"[{PROGRAM}] launcher pid {os.getpid()} written to {path}", file=sys.stderr)
                code = run_commands(plan.commands)
        except LauncherError as error:
            print(f"{PROGRAM}: error: {error}", file=sys.stderr)
            return 2
    if code != 0:
        remote = len(plan.commands) > 1 or plan.commands[0].hold_stdin
        where = "this machine (remote nodes report their own)" if remote else "this machine"
        # A job stopped on purpose (Ctrl-C, SIGTERM) without a failed rank needs no "no record" line.
        stopped = code in (EXIT_CODE_INTERRUPTED, EXIT_CODE_TERMINATED)
        if not (stopped and not failure_report.read_failures(failure_dir)[0]):
            for line in failure_report.report_lines(failure_dir, where=where):
                print(line, file=sys.stderr)
    return code


@contextlib.contextmanager
def pid_file(pid: int, directory: str | None = None) -> Iterator[str]:
    """DeepSpeed's ``--save_pid``: ``<tmpdir>/<pid>.deepspeed`` holds the launcher's pid while the job runs, so a
    program that started the launcher can find (and signal: SIGTERM stops the whole job) the process to stop.
    The file is removed when the launch returns."""
    path = os.path.join(directory or tempfile.gettempdir(), f"{pid}.deepspeed")
    if os.path.exists(path):
        raise LauncherError(f"--save_pid: {path} already exists (another launcher with this pid?)")
    with open(path, "w") as handle:
        handle.write(str(pid))
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardspeed`` console script; returns the process exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        subcommand = get_subcommand(words[0]) if words else None
        if subcommand is not None:
            return subcommand.resolve()(words[1:])
        return _launch(words)
    except SystemExit as exit_request:  # argparse's --help / usage errors: report as a return code
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
