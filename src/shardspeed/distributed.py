"""Process-group start-up: read the rank layout from torchrun, SLURM or Open MPI and call init_process_group.

`init_distributed` is DeepSpeed's `deepspeed.init_distributed`: nccl when CUDA is available, else gloo. A lone
process with no launcher environment becomes a world of one (no process group is created: every collective on a
size-1 axis is skipped), so the same script runs on a laptop and on a cluster.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("shardspeed")

DEFAULT_MASTER_PORT = "29500"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as told by its launcher."""

    source: str  # "torchrun", "slurm", "mpi" or "none"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: str | None


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as 'node[003-007,9],gpu1' -> 'node003' (no scontrol needed)."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix + first


def detect_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """Read the launcher's variables. torchrun's names win, then SLURM's, then Open MPI's; none → world of 1."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            env.get("MASTER_ADDR"),
            env.get("MASTER_PORT"),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        return LaunchEnv(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            env.get("MASTER_ADDR") or (_first_slurm_host(nodelist) if nodelist else None),
            env.get("MASTER_PORT"),
        )
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchEnv(
            "mpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0,
            env.get("MASTER_ADDR"),
            env.get("MASTER_PORT"),
        )
    return LaunchEnv("none", 0, 1, 0, None, None)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
) -> LaunchEnv:
    """Join (or create) the default process group. Safe to call more than once.

    An already-initialized process group is respected as is. ``dist_init_required=False`` means the caller takes
    charge of initialization: if there is no process group we run as a world of one.
    """
    launch = detect_launch_env(os.environ)
    if dist.is_initialized():
        return LaunchEnv("existing", dist.get_rank(), dist.get_world_size(), launch.local_rank, None, None)
    if dist_init_required is False or (launch.world_size == 1 and launch.source == "none"):
        return launch
    if launch.source in ("slurm", "mpi"):
        # init_method env:// reads these; torchrun sets them itself.
        if launch.master_addr is None and launch.world_size > 1:
            raise RuntimeError(
                f"launched by {launch.source} with {launch.world_size} processes but MASTER_ADDR is not set "
                "and could not be derived; export MASTER_ADDR (and MASTER_PORT)"
            )
        os.environ.setdefault("MASTER_ADDR", launch.master_addr or "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", launch.master_port or DEFAULT_MASTER_PORT)
        os.environ.setdefault("RANK", str(launch.rank))
        os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
        os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    backend = dist_backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=launch.rank,
        world_size=launch.world_size,
        **kwargs,
    )
    if launch.rank == 0:
        logger.info("initialized %s process group: world %d (from %s)", backend, launch.world_size, launch.source)
    return launch
