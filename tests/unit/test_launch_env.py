from __future__ import annotations

import pytest

from shardspeed.distributed import _first_slurm_host, detect_launch_env


def test_torchrun_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    e = detect_launch_env(env)
    assert (e.source, e.rank, e.world_size, e.local_rank, e.master_addr) == ("torchrun", 3, 4, 1, "h")


def test_slurm_env_derives_master_from_nodelist() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    e = detect_launch_env(env)
    assert (e.source, e.rank, e.world_size, e.local_rank, e.master_addr) == ("slurm", 5, 8, 1, "gpu07")


def test_openmpi_env() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    e = detect_launch_env(env)
    assert (e.source, e.rank, e.world_size) == ("mpi", 2, 4)


def test_no_env_is_world_of_one() -> None:
    e = detect_launch_env({})
    assert (e.source, e.rank, e.world_size) == ("none", 0, 1)


def test_bad_integer_names_variable() -> None:
    with pytest.raises(ValueError, match="RANK='x'"):
        detect_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "nodelist,first", [("n1", "n1"), ("n1,n2", "n1"), ("node[003-007,9]", "node003"), ("a[1,4]", "a1")]
)
def test_slurm_nodelist(nodelist: str, first: str) -> None:
    assert _first_slurm_host(nodelist) == first
