"""torchrun, plus a failure record for each rank that failed without writing one (killed by a signal, or exited
before shardspeed's own handlers were in place).

``python <path>/torchrun_agent.py <torchrun args>`` is ``python -m torch.distributed.run <torchrun args>``, except
that when torchrun gives up on its worker group (``ChildFailedError``: a rank failed and no restart is left) the
failed ranks it observed are written to ``$SHARDSPEED_FAILURE_DIR/rank<R>.json`` — "rank 1 in process: killed by
SIGKILL (exit code -9)" — unless the rank wrote its own record, which says more and is kept. The launcher then
names the first failure even for a ``kill -9`` (``failure_report.py``). torchrun's time for such a failure is when
its monitor noticed it, in whole seconds.

Run by file path, like ``rank_exec.py``: it imports torch (torchrun needs it) but not the ``shardspeed`` package.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

if __package__:
    from shardspeed.launcher.failure_report import AGENT_WHERE, FAILURE_DIR_ENV, RankFailure, write_failure
else:  # run by file path: the sibling module, without importing the shardspeed package
    from failure_report import AGENT_WHERE, FAILURE_DIR_ENV, RankFailure, write_failure  # type: ignore[no-redef]

WHERE = AGENT_WHERE


def describe_exit(exitcode: int, signal_name: str) -> str:
    """``"killed by SIGKILL (exit code -9)"`` / ``"exited with code 3"``."""
    if exitcode < 0:
        return f"killed by {signal_name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _stopped_by_torchrun(exitcode: int) -> bool:
    """Ended by the SIGTERM torchrun sends the rest of the group once one rank failed (killed by it, or a handler
    exiting with the shell's 128 + SIGTERM)."""
    return exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)


def record_child_failures(directory: str, error: BaseException) -> None:
    """One record per rank in torchrun's ``ChildFailedError`` that has none yet.

    torchrun lists every rank that ended non-zero, including the ones it stopped with SIGTERM after the first
    failure, all with whole-second times; those are left out when any other failure is listed, so the record of
    the rank that caused the teardown is not outranked by its victims.
    """
    failures = dict(getattr(error, "failures", {}))
    causes = {rank: failure for rank, failure in failures.items() if not _stopped_by_torchrun(failure.exitcode)}
    for rank, failure in (causes or failures).items():
        record = RankFailure(
            rank=int(rank),
            time=float(failure.timestamp),
            where=WHERE,
            error=describe_exit(failure.exitcode, failure.signal_name()),
        )
        try:
            write_failure(directory, record, replace=False)
        except OSError as write_error:  # never hide torchrun's own error behind ours
            print(f"[shardspeed] could not write {directory}: {write_error}", file=sys.stderr)


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser without argparse's abbreviations: torchrun's own ``main()`` allows them, so a
    script argument that is a prefix of a torchrun option (``--run`` → ``--run-path`` / ``--run_path``) failed the
    whole launch. The launcher always spells torchrun's options in full."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    return parser


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import run

    try:
        record(run)(torchrun_parser().parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as error:
        directory = os.environ.get(FAILURE_DIR_ENV)
        if directory and os.path.isdir(directory):
            record_child_failures(directory, error)
        raise


if __name__ == "__main__":
    main()
