"""What torchrun starts for each rank: it sets the rank up the way DeepSpeed's launcher does, then execs the script.

``python <path>/rank_exec.py [options] --script SCRIPT [ARGS...]`` runs, in this process (``os.execvpe``, so torchrun
supervises the script itself: its signals, its exit code)::

    python -u SCRIPT --local_rank=N ARGS...         (default; N is torchrun's LOCAL_RANK)
    python -u -m SCRIPT --local_rank=N ARGS...      (--module)
    SCRIPT --local_rank=N ARGS...                   (--no_python: an executable)

``--no_local_rank`` leaves ``--local_rank=N`` out (the script reads ``LOCAL_RANK`` from the environment, which
torchrun always sets). Why not torchrun alone: torchrun never passes the local rank as an argument (its
``--use-env`` is always on), while DeepSpeed's examples declare ``parser.add_argument("--local_rank")`` and
DeepSpeed's launcher passes ``--local_rank=N`` right after the script — before the user's arguments, so a script
that stops parsing early (``parse_known_args``) still sees it.

``--bind_cores_to_rank``: this rank's share of the cores (``--bind_core_list``, default: the cores this process
may run on), contiguous slices of ``len(cores) // LOCAL_WORLD_SIZE`` cores in local-rank order, is set as the CPU
affinity (inherited through exec; no numactl needed) and ``OMP_NUM_THREADS`` is set to the slice's size, as
DeepSpeed does. ``--each_rank_log DIR --log_prefix P``: stdout and stderr go to ``DIR/P_rank{RANK}.log``.

The separator is the word ``--script``, not ``--``: torchrun hands the words after its script over through
argparse's REMAINDER, which drops a leading ``--``.

Standard library only and run by file path: a rank should start without importing torch twice.
"""

from __future__ import annotations

import os
import sys

SEPARATOR = "--script"
USAGE = (
    "usage: rank_exec.py [--module] [--no_python] [--no_local_rank] [--bind_cores_to_rank] [--bind_core_list L] "
    "[--each_rank_log DIR --log_prefix P] --script SCRIPT [ARGS...]"
)


class RankExecError(ValueError):
    """Bad options or a bad core list: reported on stderr, exit code 2."""


def parse_core_list(text: str) -> list[int]:
    """DeepSpeed's core list syntax: "0,2-4,7" → [0, 2, 3, 4, 7] (order kept, duplicates refused)."""
    cores: list[int] = []
    for piece in text.split(","):
        bounds = piece.strip().split("-", 1)
        if not all(bound.isdigit() for bound in bounds):
            raise RankExecError(f"--bind_core_list {text!r}: {piece!r} is not a core number or a range a-b")
        first, last = int(bounds[0]), int(bounds[-1])
        if last < first:
            raise RankExecError(f"--bind_core_list {text!r}: range {piece!r} runs backwards")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise RankExecError(f"--bind_core_list {text!r}: cores must be distinct")
    return cores


def cores_for_rank(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """Local rank ``r``'s contiguous slice of ``cores`` (each rank gets ``len(cores) // local_world_size``)."""
    if not 0 <= local_rank < local_world_size:
        raise RankExecError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}")
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise RankExecError(
            f"--bind_cores_to_rank: {len(cores)} core(s) for {local_world_size} local ranks; each rank needs one"
        )
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def parse(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    """Split ``argv`` into this shim's options and the user's command (after ``--script``)."""
    if SEPARATOR not in argv:
        raise RankExecError(f"missing {SEPARATOR!r} before the script\n{USAGE}")
    split = argv.index(SEPARATOR)
    words, command = argv[:split], argv[split + 1 :]
    if not command:
        raise RankExecError(f"missing the script after {SEPARATOR!r}\n{USAGE}")
    options: dict[str, object] = {
        "module": False,
        "no_python": False,
        "no_local_rank": False,
        "bind_cores_to_rank": False,
        "bind_core_list": None,
        "each_rank_log": None,
        "log_prefix": "",
    }
    index = 0
    while index < len(words):
        name = words[index].removeprefix("--")
        if name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank"):
            options[name] = True
            index += 1
        elif name in ("bind_core_list", "each_rank_log", "log_prefix") and index + 1 < len(words):
            options[name] = words[index + 1]
            index += 2
        else:
            raise RankExecError(f"unknown option {words[index]!r}\n{USAGE}")
    if options["module"] and options["no_python"]:
        raise RankExecError("--module and --no_python cannot be used together (a module needs python)")
    return options, command


def build_command(options: dict[str, object], command: list[str], environ: dict[str, str]) -> list[str]:
    """The argv to exec for this rank."""
    script, script_args = command[0], command[1:]
    if options["no_python"]:
        argv = [script]
    elif options["module"]:
        argv = [sys.executable, "-u", "-m", script]
    else:
        argv = [sys.executable, "-u", f"./{script}" if script.startswith("-") else script]
    if not options["no_local_rank"]:
        argv.append(f"--local_rank={environ.get('LOCAL_RANK', '0')}")
    return argv + script_args


def main(argv: list[str] | None = None) -> int:
    try:
        options, command = parse(sys.argv[1:] if argv is None else argv)
        environ = dict(os.environ)
        exec_argv = build_command(options, command, environ)
        if options["bind_cores_to_rank"]:
            listed = options["bind_core_list"]
            cores = parse_core_list(str(listed)) if listed else sorted(os.sched_getaffinity(0))
            mine = cores_for_rank(cores, int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1")))
            os.sched_setaffinity(0, mine)
            environ["OMP_NUM_THREADS"] = str(len(mine))
        if options["each_rank_log"]:
            directory = str(options["each_rank_log"])
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{options['log_prefix']}_rank{environ.get('RANK', '0')}.log")
            log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
    except (RankExecError, OSError) as error:
        print(f"[shardspeed rank_exec] error: {error}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(exec_argv[0], exec_argv, environ)
    except OSError as error:  # exec failed: no such executable, not executable, ...
        print(f"[shardspeed rank_exec] cannot run {exec_argv[0]!r}: {error}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
