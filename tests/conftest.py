"""Shared fixtures. Warm lazy imports once in the parent so forked ranks start fast."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The suite runs on CPU (gloo, forked ranks) even on a GPU host: the engine would put every forked rank on
# cuda:LOCAL_RANK, and CUDA does not survive fork ([Note: CUDA tests and forked ranks] in tests/cuda/cuda_support.py).
# Hidden before torch is asked anything; `make gpu-check` sets SHARDSPEED_TEST_CUDA=1 for the tests/cuda path.
if os.environ.get("SHARDSPEED_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch
import torch._dynamo  # ZeRO-3 registers its hooks through torch.compiler.disable, which imports dynamo (seconds)
import torch.distributed

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_ranks

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _private_calibration_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Collective calibrations (comm/calibrate.py) are cached per host: a developer's cache, or one a previous
    test wrote, must not change which algorithm a test runs. Forked ranks inherit the variable."""
    monkeypatch.setenv("SHARDSPEED_CACHE_DIR", str(tmp_path / "shardspeed-cache"))


@pytest.fixture
def dist_run(tmp_path: Path):
    """``dist_run(fn, world_size, *args)`` → per-rank results of fn(rank, world_size, *args)."""

    def _run(fn, world_size: int, *args, **kwargs):
        return run_ranks(fn, world_size, tmp_path, *args, **kwargs)

    return _run
