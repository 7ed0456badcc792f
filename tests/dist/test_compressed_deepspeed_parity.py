"""Parity with DeepSpeed 0.19.6's own ``CompressedBackend.compressed_allreduce`` (runtime/comm/compressed.py, the
last release with 1-bit optimizers), run over the same gloo ranks: its source is executed with torch.distributed
as ``deepspeed.comm`` and our packer (tests/dist/deepspeed_onebit_source.py). Our one-process reference, and so
``CompressedAllReduce`` (matched to it bit for bit in test_compressed_collectives.py), must give DeepSpeed's
result and error buffers over several steps. Skipped where the 0.19.6 source is not unpacked (DS0196_SRC, default
/work/ds0196src)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from deepspeed_onebit_source import COMPRESSED, compressed_backend_class

from harness import run_ranks
from shardspeed.compression import reference
from shardspeed.compression.signs import padded_numel

pytestmark = pytest.mark.skipif(not COMPRESSED.is_file(), reason=f"DeepSpeed 0.19.6 source not found at {COMPRESSED}")


def _parity(rank: int, world: int, numel: int, steps: int) -> dict[str, float]:
    backend = compressed_backend_class()()
    padded = padded_numel(numel, world)
    ds_worker, ds_server = torch.zeros(padded), torch.zeros(padded // world)
    we, se = [torch.zeros(padded) for _ in range(world)], [torch.zeros(padded // world) for _ in range(world)]
    worst = {"result": 0.0, "worker_error": 0.0, "server_error": 0.0}
    for step in range(steps):
        xs = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]
        theirs = backend.compressed_allreduce(xs[rank].clone(), ds_worker, ds_server, 0)
        ours = reference.compressed_allreduce(xs, we, se)
        for key, a, b in (
            ("result", theirs, ours),
            ("worker_error", ds_worker, we[rank]),
            ("server_error", ds_server, se[rank]),
        ):
            worst[key] = max(worst[key], (a - b).abs().max().item())
    return worst


@pytest.mark.parametrize("world,numel", [(2, 1003), (4, 2048)])
def test_reference_equals_deepspeed_compressed_allreduce(tmp_path: Any, world: int, numel: int) -> None:
    for worst in run_ranks(_parity, world, tmp_path, numel, 3):
        assert worst == {"result": 0.0, "worker_error": 0.0, "server_error": 0.0}
