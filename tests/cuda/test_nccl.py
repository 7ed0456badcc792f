"""NCCL, one rank per GPU (≥ 2 GPUs: NCCL refuses two ranks on one GPU): ZeRO 0-3, TP=2 and PP=2 against the
single-process CPU reference. PP=2 is the first run of pipe/links.py's per-direction 2-rank communicators on NCCL.
Run in its own pytest process (gpu_check's ``nccl`` check)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cases import FP32_ATOL
from cuda_support import gpu_count_reason, run_spawned_ranks
from multi_cases import pipe_parity, tp_parity, zero_parity

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(bool(gpu_count_reason(2)), reason=gpu_count_reason(2) or "-")]


def _nccl(fn: Callable[..., Any], tmp: Path, *args: Any) -> list[Any]:
    return run_spawned_ranks(fn, 2, tmp, *args, backend="nccl", shared_gpu=False)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict]]:
    return _nccl(zero_parity, tmp_path_factory.mktemp("zero"), [0, 1, 2, 3])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_parity_on_nccl(zero_runs: list[dict[int, dict]], stage: int) -> None:
    for rank, ranks in enumerate(zero_runs):
        run = ranks[stage]
        assert run["error"] == "", f"rank {rank}: {run['error']}\n{run.get('trace', '')}"
        assert run["device"] == f"cuda:{rank}"
        assert run["diff"] <= FP32_ATOL and run["norm_rel"] <= 1e-5, (rank, run)


def test_tp2_parity_on_nccl(tmp_path: Path) -> None:
    for ranks in _nccl(tp_parity, tmp_path, [0, 3]):
        for stage, (diff, moved) in ranks.items():
            assert diff <= FP32_ATOL and moved > 1e-3, (stage, diff, moved)


def test_pp2_parity_on_nccl_links(tmp_path: Path) -> None:
    for rank, ranks in enumerate(_nccl(pipe_parity, tmp_path, ["1f1b", "gpipe"])):
        for schedule, run in ranks.items():
            assert run["device"] == f"cuda:{rank}"
            assert run["diff"] <= FP32_ATOL and run["moved"] > 1e-3 and run["loss_diff"] <= 1e-5, (schedule, run)
