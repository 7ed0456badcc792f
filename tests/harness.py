"""Multi-rank test harness: fork N ranks that join a gloo group through a FileStore in a temp dir (no ports).

Why fork: a 2-rank test runs in well under a second once torch is imported in the parent (the children inherit
the imported modules). Why OMP_NUM_THREADS=1 before pytest starts and set_num_threads(1) in each child: a forked
child hangs on its first parallel op once the parent's OpenMP pool has run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.faults.process import current_failure

PG_TIMEOUT_S = 30.0  # a hung collective fails the test quickly instead of at the pytest-timeout
JOIN_DEADLINE_S = 90.0


class RankFailure(AssertionError):
    """One or more ranks raised. ``errors`` maps rank → (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]], results: list[Any] | None = None) -> None:
        self.errors = errors
        self.results = results or []  # what the other ranks returned (None for the failed ones)
        detail = "\n".join(f"--- rank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{detail}")

    def messages(self) -> list[str]:
        return [m for _, m, _ in (self.errors[r] for r in sorted(self.errors))]


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, store_path: str, conn: Any, args: tuple, kwargs: dict
) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = (
        str(rank),
        str(world_size),
        str(rank),
    )
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S)
        )
        # gloo connects its mesh asymmetrically: a rank that returns (and exits) before its peers finished
        # connecting makes them fail with "connection closed by peer". One barrier settles the mesh.
        dist.barrier()
        result = fn(rank, world_size, *args, **kwargs)
        payload = ("ok", result)
    except BaseException as exc:  # report everything, including SystemExit from a CLI under test
        payload = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception as exc:  # an unpicklable result is a test bug; say so
        conn.send_bytes(pickle.dumps(("err", ("PicklingError", str(exc), ""))))
    conn.close()
    try:
        # After a failure a collective may still be pending with a peer that is gone or never comes: destroying the
        # group would wait for it ([Note: failure propagation] in faults/board.py). Just leave.
        if dist.is_initialized() and payload[0] == "ok" and current_failure() is None:
            dist.destroy_process_group()
    finally:
        os._exit(0)  # skip pytest's atexit machinery inherited from the parent


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    deadline_s: float = JOIN_DEADLINE_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks; return results by rank."""
    ctx = mp.get_context("fork")
    store_path = str(tmp_path / f"store-{time.monotonic_ns()}")
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(fn, rank, world_size, store_path, child_conn, args, kwargs))
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)
    results: list[Any] = [None] * world_size
    errors: dict[int, tuple[str, str, str]] = {}
    end = time.monotonic() + deadline_s
    for rank, conn in enumerate(conns):
        remaining = max(0.0, end - time.monotonic())
        if conn.poll(remaining):
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                status, value = "err", ("EOFError", "rank died without reporting", "")
        else:
            status, value = "err", ("Timeout", f"no result within {deadline_s}s (hang?)", "")
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = value
    for proc in procs:
        proc.join(timeout=max(0.1, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    if errors:
        raise RankFailure(errors, results)
    return results


def deleted_files_held(under: str | os.PathLike[str], pid: int | str = "self") -> dict[str, str]:
    """``/proc/<pid>/fd/<n>`` → target for each descriptor of ``pid`` on an unlinked file that was under ``under``:
    the NVMe swap files (they are unlinked as soon as they are created, so only open descriptors show them)."""
    held = {}
    for entry in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{entry}"
        try:
            target = os.readlink(link)
        except FileNotFoundError:  # closed while we looked (the descriptor listdir itself used)
            continue
        if target.startswith(str(under)) and target.endswith(" (deleted)"):
            held[link] = target
    return held


def error_of(build: Callable[[], object]) -> str:
    """``"<ExceptionType>: <message>"`` of what ``build()`` raised on this rank, or ``"no error"``: rank functions
    return it so a test can check every rank failed with the same clear error (and none hung)."""
    try:
        build()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
