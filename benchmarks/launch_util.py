"""What every benchmark launcher needs to start child processes: a free rendezvous port and the child's environment.

One copy instead of one per launcher (bench_engine, bench_pipe, bench_tp_dtensor, bench_order_check,
bench_clean_exit, fault_procs, bench_versions): the children must see this checkout's ``src/`` first (a checkout
works without ``pip install -e .``), run one thread per rank unless told otherwise (2 ranks on a 2-core machine,
no oversubscription), and, on CPU, see no GPU (the shardspeed engine would otherwise pick a visible one, and every
row of a comparison must run on the same device).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_SRC = REPO_ROOT / "src"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; a race with another process is possible but rare,
    and the launchers that care retry on 'address already in use')."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(
    *,
    paths: Iterable[Path | str] = (),
    cpu_only: bool = True,
    force_one_thread: bool = False,
    unset: Iterable[str] = (),
    **overrides: str,
) -> dict[str, str]:
    """This process's environment for a child, with ``src/`` (then ``paths``) in front of ``PYTHONPATH``.

    ``OMP_NUM_THREADS`` defaults to 1 (``force_one_thread``: 1 even when the caller's environment set another);
    ``cpu_only`` hides every GPU (``CUDA_VISIBLE_DEVICES=""``); ``unset`` drops variables the child must not
    inherit (e.g. a fault-injection spec); ``overrides`` are set last.
    """
    env = dict(os.environ)
    if force_one_thread:
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    front = [str(REPO_SRC), *(str(p) for p in paths)]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*front, env.get("PYTHONPATH")]))
    for name in unset:
        env.pop(name, None)
    env.update(overrides)
    return env
