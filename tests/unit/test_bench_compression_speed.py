"""benchmarks/bench_compression_speed.py's rank placement for ``--device`` (pure; the CUDA rows need a GPU host:
``make gpu-check``'s ``bench-compression-cuda``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_compression_speed import parse_args, placement


def test_placement_gloo_on_cpu_nccl_with_a_gpu_per_rank_else_every_rank_on_cuda0() -> None:
    assert placement("cpu", 2, 0) == ("gloo", "gloo on CPU", None)
    assert placement("cuda", 2, 2) == ("nccl", "NCCL, one GPU per rank", None)
    assert placement("cuda", 4, 8)[0] == "nccl"
    assert placement("cuda", 2, 1) == ("gloo", "gloo, all 2 ranks on cuda:0 (1 GPU)", 0)  # NCCL refuses sharing
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        placement("cuda", 2, 0)


def test_cuda_without_a_gpu_is_refused_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda"])
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
