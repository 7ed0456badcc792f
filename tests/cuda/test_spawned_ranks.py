"""The multi-process CUDA tests' own machinery, on CPU: ``run_spawned_ranks`` (spawned ranks, gloo) and the rank
functions of ``multi_cases.py`` give the parity results the CPU suite gives, so on a GPU host a failure is about
CUDA, not about the test code (which no CI machine could otherwise run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cuda_support import RankFailure, run_spawned_ranks
from multi_cases import FP32_ATOL, PROBES, everything


@pytest.mark.slow  # about 30 s of CPU (every case, one group); `make test-all` runs it
def test_spawned_gloo_ranks_on_cpu_run_the_multi_process_cases(tmp_path: Path) -> None:
    results = run_spawned_ranks(everything, 2, tmp_path, backend="gloo", shared_gpu=True)
    for r in results:
        assert r["probes"] == dict.fromkeys(PROBES, "ok")  # gloo carries every op the engine uses with CPU tensors
        for stage, z in r["zero"].items():
            assert z["error"] == "" and z["device"] == "cpu", (stage, z)
            assert z["diff"] <= FP32_ATOL and z["norm_rel"] <= 1e-5, (stage, z)
        diff, moved = r["tp"][1]
        assert diff <= FP32_ATOL and moved > 1e-3
        pipe = r["pipe"]["1f1b"]
        assert pipe["diff"] <= FP32_ATOL and pipe["moved"] > 1e-3 and pipe["loss_diff"] <= 1e-5


def test_a_rank_that_raises_is_reported_by_rank(tmp_path: Path) -> None:
    with pytest.raises(RankFailure, match="rank 1: ValueError: only rank 1"):
        run_spawned_ranks(_fail_on_rank_1, 2, tmp_path, backend="gloo")


def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("only rank 1")
    return rank
