"""What the CUDA tests share: when they run (skip reasons) and a rank runner for gloo or NCCL ranks on GPUs.

[Note: CUDA tests and forked ranks] The CPU suite's harness forks its ranks from the pytest process. A process
that asked CUDA anything (even ``torch.cuda.is_available()`` without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) cannot
use CUDA in a forked child ("Cannot re-initialize CUDA in forked subprocess"), and the engine puts every rank on
``cuda:LOCAL_RANK`` whenever CUDA is visible. So tests/conftest.py hides CUDA from the suite unless
``SHARDSPEED_TEST_CUDA=1`` (gpu_check sets it): the CPU suite stays on CPU on a GPU host, and these tests skip there
like on a CPU-only machine. The multi-rank CUDA tests start their ranks with ``spawn``: fresh interpreters, whatever
the parent did with CUDA.
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

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure  # the CPU harness's error, so failures read the same

__all__ = ["RankFailure", "cuda_skip_reason", "gpu_count_reason", "requires_cuda", "run_spawned_ranks"]

OPT_IN = "SHARDSPEED_TEST_CUDA"
DEADLINE_S = 150.0  # spawned ranks import torch and start CUDA: slower than the CPU harness's forks


def cuda_skip_reason() -> str:
    """Why the CUDA tests cannot run in this process ("" when they can)."""
    if os.environ.get(OPT_IN) != "1":
        return f"{OPT_IN} is not 1: the suite runs on CPU (tests/conftest.py hides CUDA); make gpu-check runs these"
    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False (torch {torch.__version__})"
    return ""


def gpu_count_reason(needed: int) -> str:
    """Why a test needing ``needed`` GPUs (one rank per GPU) cannot run ("" when it can)."""
    reason = cuda_skip_reason()
    if reason:
        return reason
    if not dist.is_nccl_available():
        return f"torch.distributed.is_nccl_available() is False (torch {torch.__version__})"
    count = torch.cuda.device_count()
    if count < needed:
        return f"{count} CUDA device(s); NCCL needs one GPU per rank ({needed} ranks), it refuses two on one GPU"
    return ""


requires_cuda = pytest.mark.skipif(bool(cuda_skip_reason()), reason=cuda_skip_reason() or "CUDA is available")


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    out_path: str,
    backend: str,
    shared_gpu: bool,
    args: tuple,
    kwargs: dict,
) -> None:
    """One spawned rank. ``shared_gpu``: every rank's LOCAL_RANK is 0, so the engine (``cuda:LOCAL_RANK``) puts
    them all on ``cuda:0`` — only gloo allows that. Otherwise rank r is on GPU r (``LOCAL_RANK=r``), as torchrun
    and init_distributed set it up for NCCL."""
    torch.set_num_threads(1)
    local = 0 if shared_gpu else rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local))
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(local)  # what init_distributed does for NCCL; harmless for gloo
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        dist.barrier()
        payload = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:
        payload = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
    try:
        blob = pickle.dumps(payload)
    except Exception as exc:  # a CUDA tensor or other unpicklable result is a test bug: say so
        blob = pickle.dumps(("err", ("PicklingError", str(exc), "")))
    Path(out_path).write_bytes(blob)
    if payload[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


def run_spawned_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    backend: str = "gloo",
    shared_gpu: bool = True,
    deadline_s: float = DEADLINE_S,
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks joined in a ``backend`` group;
    results by rank (return CPU tensors or plain values). ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    stamp = time.monotonic_ns()
    store_path = str(tmp_path / f"store-{stamp}")
    outs = [tmp_path / f"rank{r}-{stamp}.pkl" for r in range(world_size)]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, store_path, str(outs[r]), backend, shared_gpu, args, kwargs),
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    end = time.monotonic() + deadline_s
    for proc in procs:
        proc.join(timeout=max(0.1, end - time.monotonic()))
    results: list[Any] = [None] * world_size
    errors: dict[int, tuple[str, str, str]] = {}
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        if proc.is_alive():
            proc.kill()
            proc.join()
            errors[rank] = ("Timeout", f"no result within {deadline_s}s (hang?)", "")
        elif not out.exists():
            errors[rank] = ("Died", f"rank exited with status {proc.exitcode} without reporting", "")
        else:
            status, value = pickle.loads(out.read_bytes())
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
    if errors:
        raise RankFailure(errors, results)
    return results
