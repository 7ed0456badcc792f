"""Which rank failed first, and why: the launcher's side of ``SHARDSPEED_FAILURE_DIR``.

Per launch the launcher creates a fresh temporary directory (:func:`failure_dir`), names it in every rank's
environment as ``SHARDSPEED_FAILURE_DIR`` and removes it when the launch returns. A rank that fails writes
``rank<R>.json`` there — ``{"rank": int, "time": epoch seconds, "where": str, "error": "Type: message"}`` (the
rank side lives in ``shardspeed.faults``; torchrun's agent adds a record for a rank killed by a signal, which
cannot write its own: ``torchrun_agent.py``). After a failed job the launcher prints the earliest record::

    [shardspeed] first failure: rank 1 in engine.step() at step 3: RuntimeError: ...

Multi-node over ssh/pdsh: the directory is a path on the launcher's machine. Each remote node gets the same path
(``remote_node.py`` creates it there when missing), but its records stay on that node: the launcher reports what
*its own* machine's directory holds — the local node's ranks, or every node's when the "nodes" share this
machine, as in the stub-ssh tests. A remote node's records are printed by that node's ``remote_node.py`` into
its output, which ssh carries back.

Standard library only: ``remote_node.py`` (run by file path, no torch) loads this file too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

FAILURE_DIR_ENV = "SHARDSPEED_FAILURE_DIR"
PREFIX = "[shardspeed]"
AGENT_WHERE = "process"
"""``where`` of the records torchrun's agent writes for ranks that wrote none (``torchrun_agent.py``)."""


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """One rank's failure record, as a rank writes it."""

    rank: int
    time: float
    where: str
    error: str

    def line(self) -> str:
        return f"{PREFIX} first failure: rank {self.rank} in {self.where}: {self.error}"


@contextlib.contextmanager
def failure_dir() -> Iterator[str]:
    """A fresh, empty directory for one launch's failure records; removed with its contents afterwards."""
    path = tempfile.mkdtemp(prefix="shardspeed-failures-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def _parse(text: str) -> RankFailure:
    data = json.loads(text)
    return RankFailure(
        rank=int(data["rank"]), time=float(data["time"]), where=str(data["where"]), error=str(data["error"])
    )


def read_failures(directory: str) -> tuple[list[RankFailure], list[str]]:
    """Every readable ``rank<R>.json`` in ``directory`` (rank-written records first, each kind earliest first), and
    the names of files that were not
    valid records (a rank killed while writing one leaves a partial file)."""
    failures: list[RankFailure] = []
    unreadable: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return [], []
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                failures.append(_parse(handle.read()))
        except (OSError, ValueError, KeyError, TypeError):
            unreadable.append(name)
    # A rank's own record (an exception it raised, or a peer's death it saw) names a cause; the agent's records
    # only say that a process exited, and carry torchrun's whole-second times, which would sort a rank that exited
    # *because* of another's failure ahead of it. So the agent's records come after every rank-written one.
    failures.sort(key=lambda failure: (failure.where == AGENT_WHERE, failure.time, failure.rank))
    return failures, unreadable


def report_lines(directory: str, *, where: str = "this machine") -> list[str]:
    """What the launcher prints about a failed job: the earliest record, or why there is none."""
    failures, unreadable = read_failures(directory)
    lines = []
    if failures:
        lines.append(failures[0].line())
        if len(failures) > 1:
            others = ", ".join(f"rank {failure.rank}" for failure in failures[1:])
            lines.append(f"{PREFIX} later failure records: {others}")
    else:
        lines.append(f"{PREFIX} no rank on {where} wrote a failure record (see the ranks' output above)")
    if unreadable:
        lines.append(f"{PREFIX} unreadable failure records: {', '.join(unreadable)}")
    return lines


def write_failure(directory: str, failure: RankFailure, *, replace: bool = True) -> bool:
    """Write ``failure`` as ``rank<R>.json`` atomically (tmp file + rename), so a reader never sees half a record.
    With ``replace=False`` an existing record of that rank (the rank's own, more informative one) is kept.
    Returns whether it was written."""
    path = record_path(directory, failure.rank)
    if not replace and os.path.exists(path):
        return False
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump({"rank": failure.rank, "time": failure.time, "where": failure.where, "error": failure.error}, handle)
    os.replace(temporary, path)
    return True
