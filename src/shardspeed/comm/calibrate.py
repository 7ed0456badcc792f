"""Resolving ``communication.collectives`` to one ``CollectiveChoice`` agreed by every rank: the per-host cache,
the start-up measurement, the documented table ([Note: collective algorithms] in comm/algorithms.py).

[Note: agreed calibration] Two ranks on different algorithms for the same logical op would post different calls
and hang, so every path ends with the same choice on every rank of the world (the engine's one ``Collectives``
serves every axis; with a tensor or pipe axis there are several data groups, which must not decide apart), and the
choice applies only to collectives over the axis it was measured on (``CollectiveChoice.axis``, the data axis):
every other axis runs native (its groups, often of another size, were never measured):
- the cache: each rank reads its own host's file (validated: a corrupt or foreign file is ignored with a
  warning, never a crash); the files are used only when every rank read the same choice (one
  ``all_gather_object`` over the world: ranks of one job on several hosts may hold different caches). The key
  names the device type the collectives move (the engine's device). Otherwise ``"auto"``
  falls back to the table and ``"calibrate"`` measures again.
- the measurement: every rank times every candidate on the same ladder over its own data group (the groups time
  concurrently), the per-size figure is the *max over the group's ranks* of each rank's median (the slowest rank is
  the one a collective waits for); world rank 0 decides from its group's figures and its decision — bucket knee
  included: it is the choice's curve — is sent to every rank (each then writes it to its own cache).
- the table: a pure function of the backend and the axis size, equal everywhere by construction.
World rank 0 logs one line saying which it is.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.comm.algorithms import (
    CANDIDATES,
    NATIVE,
    CollectiveChoice,
    SizeRule,
    Timing,
    choose,
    cores_per_rank,
    from_json,
    table_choice,
    to_json,
)
from shardspeed.comm.collectives import Collectives
from shardspeed.topology import AxisGroup

logger = logging.getLogger("shardspeed")

CACHE_ENV = "SHARDSPEED_CACHE_DIR"
LADDER_BYTES: tuple[int, ...] = tuple(1 << k for k in range(14, 25, 2))
"""16 KiB .. 16 MiB in ×4 steps: six sizes, from latency-bound to bandwidth-bound on gloo over loopback."""
WARMUP, REPS = 1, 5


def cache_dir(configured: str | None) -> Path:
    """``communication.calibration_cache``, else ``$SHARDSPEED_CACHE_DIR``, else ``~/.cache/shardspeed``."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "shardspeed"


def cache_key(backend: str, world: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, Any]:
    """What a cached calibration is valid for: backend, axis size, dtype, the tensors' device type (gloo on CUDA
    tensors copies through the host: other timings than on CPU tensors), this host and the torch version."""
    return {
        "backend": backend,
        "world": world,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "host": socket.gethostname(),
        "torch": torch.__version__,
    }


def cache_file(directory: Path, key: dict[str, Any]) -> Path:
    name = f"collectives-{key['backend']}-w{key['world']}-{key['dtype']}-{key['device']}-{key['host']}"
    name += f"-torch{key['torch']}.json"
    return directory / name.replace(os.sep, "_")


def load_cached(path: Path, key: dict[str, Any]) -> CollectiveChoice | None:
    """The cached choice at ``path``, or None: missing quietly, unreadable / corrupt / foreign with a warning."""
    if not path.exists():
        return None
    try:
        return from_json(json.loads(path.read_text()), key)
    except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        logger.warning("ignoring the cached collective calibration %s: %s", path, error)
        return None


def store_cached(path: Path, choice: CollectiveChoice, key: dict[str, Any]) -> None:
    """Write atomically (a concurrent reader sees the old file or the new one); a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(to_json(choice, key), indent=1))
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("could not cache the collective calibration in %s: %s", path, error)


def measure(
    collectives: Collectives,
    axis: AxisGroup,
    dtype: torch.dtype = torch.float32,
    ladder: Sequence[int] | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    device: torch.device | None = None,
) -> list[Timing]:
    """Time every candidate of every op on every ladder size; each figure is the max over ranks of the ranks'
    medians. Runs the calls through ``collectives`` (waited through its failure board) with a private choice
    per candidate, and leaves its choice, comms log and counters as they were."""
    device = device or torch.device("cpu")
    ladder = LADDER_BYTES if ladder is None else ladder  # read at call time: tests shorten the ladder
    warmup = WARMUP if warmup is None else warmup
    reps = REPS if reps is None else reps
    itemsize = torch.empty(0, dtype=dtype).element_size()
    saved = collectives.algorithms, collectives.log.enabled, dict(collectives.algorithm_counts)
    collectives.log.enabled = False
    medians: list[float] = []
    keys: list[tuple[str, str, int]] = []
    try:
        for nbytes in ladder:
            numel = max(axis.size, nbytes // itemsize // axis.size * axis.size)
            full = torch.ones(numel, dtype=dtype, device=device)
            shard = torch.ones(numel // axis.size, dtype=dtype, device=device)
            for op, algorithms in CANDIDATES.items():
                for algorithm in algorithms:
                    collectives.algorithms = _only(op, algorithm)
                    samples = []
                    for i in range(warmup + reps):
                        start = time.perf_counter()
                        if op == "reduce_scatter":
                            collectives.reduce_scatter(shard, full, axis, clobber_input=True, tag="calibrate")
                        else:
                            collectives.all_gather(full, shard, axis, tag="calibrate")
                        if i >= warmup:
                            samples.append(time.perf_counter() - start)
                    medians.append(statistics.median(samples))
                    keys.append((op, algorithm, numel * itemsize))
        slowest = torch.tensor(medians, dtype=torch.float64)
        collectives.all_reduce_max(slowest, axis, tag="calibrate")
    finally:
        collectives.algorithms, collectives.log.enabled = saved[0], saved[1]
        collectives.algorithm_counts.clear()
        collectives.algorithm_counts.update(saved[2])
        for key in [k for k in collectives.blocked.seconds if k.endswith(":calibrate")]:
            del collectives.blocked.seconds[key], collectives.blocked.waits[key]  # not the job's exposed comm
    return [Timing(op, algo, nbytes, s) for (op, algo, nbytes), s in zip(keys, slowest.tolist(), strict=True)]


def _only(op: str, algorithm: str) -> CollectiveChoice:
    return CollectiveChoice(**{op: (SizeRule(None, algorithm),)})  # type: ignore[arg-type]


def usable_cpus() -> list[int]:
    """The CPUs this process may run on: its affinity where the OS has one (Linux), else every CPU (macOS has no
    ``sched_getaffinity``; a laptop run must not fail here)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return sorted(affinity(0)) if affinity is not None else list(range(os.cpu_count() or 1))


def resolve_choice(
    mode: str,
    configured_dir: str | None,
    collectives: Collectives,
    axis: AxisGroup,
    dtype: torch.dtype,
    device: torch.device | None = None,
    world: AxisGroup | None = None,
) -> CollectiveChoice:
    """``communication.collectives`` → the choice for collectives over ``axis``, the same on every rank of
    ``world`` (default: ``axis``), ``axis`` included ([Note: agreed calibration]). ``world`` must hold every rank
    that runs collectives with this ``Collectives``: each of several data groups would otherwise decide on its own,
    and two ranks of one tensor group could then disagree. ``device``: where the timed tensors live (the engine's;
    default the CPU). ``mode`` is the same on every rank (one config), and the axis size and backend are too: every
    branch below is taken alike on every rank of ``world``."""
    if mode == "native" or axis.size == 1:
        return NATIVE
    backend = dist.get_backend(axis.group)
    if backend != "gloo":  # NCCL: its native ops are the fast path
        return NATIVE
    world = axis if world is None else world
    device = torch.device("cpu") if device is None else device
    itemsize = torch.empty(0, dtype=dtype).element_size()
    key = cache_key(backend, axis.size, dtype, device.type)
    path = cache_file(cache_dir(configured_dir), key)
    mine = load_cached(path, key)
    placement = (socket.gethostname(), usable_cpus())
    gathered = collectives.all_gather_object((None if mine is None else to_json(mine, {}), placement), world)
    everyone = [cached for cached, _ in gathered]
    cores = cores_per_rank([where for _, where in gathered])  # the same on every rank: computed from one gather
    if everyone[0] is not None and all(c == everyone[0] for c in everyone):
        choice = mine
    elif mode == "calibrate":
        start = time.perf_counter()
        timings = measure(collectives, axis, dtype, device=device)  # every group of ``axis`` times its own
        decided = choose(timings, axis.size, itemsize) if world.rank == 0 else None
        shared = collectives.all_gather_object(None if decided is None else to_json(decided, {}), world)[0]
        choice = replace(from_json(shared, {}), source="calibration")  # world rank 0's decision, on every rank
        store_cached(path, choice, key)
        if world.rank == 0:
            logger.info("collective calibration took %.2f s, cached in %s", time.perf_counter() - start, path)
    else:
        if mine is not None and world.rank == 0:
            logger.info("the cached collective calibrations differ between ranks: using the table")
        choice = table_choice(backend, axis.size, itemsize)
    assert choice is not None
    choice = replace(choice, axis=axis.name, cores_per_rank=cores)  # measured on ``axis``: other axes run native
    if world.rank == 0:
        logger.info(choice.describe())
    return choice


# --- `python -m shardspeed.comm.calibrate`: the measured table ----------------------------------------------------
def format_table(timings: Sequence[Timing], world: int) -> str:
    """sizes × op × algorithm: ms and bus GB/s (nccl-tests' busbw: (N-1)/N × bytes / time)."""
    sizes = sorted({t.nbytes for t in timings})
    by = {(t.op, t.algorithm, t.nbytes): t.seconds for t in timings}
    head = f"{'op / algorithm':<28}" + "".join(f"{_size(n):>18}" for n in sizes)
    lines = [f"world {world}; ms (bus GB/s)", head]
    for op, algorithms in CANDIDATES.items():
        for algo in algorithms:
            cells = []
            for n in sizes:
                s = by.get((op, algo, n))
                cells.append(f"{s * 1e3:9.3f} ({n * (world - 1) / world / s / 1e9:5.2f})" if s else f"{'-':>18}")
            lines.append(f"{op + ' ' + algo:<28}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


def _worker(rank: int, world: int, store_path: str, reps: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    axis = AxisGroup("data", group, tuple(range(world)), rank)
    collectives = Collectives()
    start = time.perf_counter()
    timings = measure(collectives, axis, reps=reps)
    took = time.perf_counter() - start
    if rank == 0:
        out.put((timings, took))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import multiprocessing as mp
    import tempfile

    parser = argparse.ArgumentParser(description="Measure gloo's collective algorithms (CPU) and print the table.")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=REPS)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_worker, args=(r, args.world, store, args.reps, out)) for r in range(args.world)]
        for p in procs:
            p.start()
        timings, took = out.get()
        for p in procs:
            p.join()
    print(format_table(timings, args.world))
    choice = choose(timings, args.world, 4)
    print(f"measured in {took:.2f} s")
    print(choice.describe())
    print("table rows (op, algorithm, bytes, ms):")
    for t in timings:
        print(f'    ("{t.op}", "{t.algorithm}", {t.nbytes}, {t.seconds * 1e3:.3f}),')


if __name__ == "__main__":
    main()
