"""The engine's device rule (``distributed.rank_device``): cuda:LOCAL_RANK when CUDA devices are visible, the CPU
otherwise, and a clear error — not CUDA's "invalid device ordinal" at the first copy — when LOCAL_RANK has no GPU
(e.g. two ranks started on a one-GPU host, or a launcher that shows each rank only its own GPU as cuda:0)."""

from __future__ import annotations

import pytest
import torch

from shardspeed.distributed import local_rank_device, rank_device


def test_cuda_local_rank_or_cpu() -> None:
    assert rank_device(0, 0) == torch.device("cpu")
    assert rank_device(3, 0) == torch.device("cpu")  # no CUDA: every rank on the CPU, whatever LOCAL_RANK says
    assert rank_device(0, 1) == torch.device("cuda", 0)
    assert rank_device(1, 2) == torch.device("cuda", 1)


def test_local_rank_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 but this process sees 1 CUDA device\(s\)") as caught:
        rank_device(1, 1)
    assert "at most 1 process(es) per node" in str(caught.value) and "CUDA_VISIBLE_DEVICES" in str(caught.value)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=-1"):
        rank_device(-1, 2)


def test_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert local_rank_device() == expected
