"""Parity with DeepSpeed 0.19.6's own ``CompressedBackend.compressed_allreduce`` (runtime/comm/compressed.py, the
last release with 1-bit optimizers), run over the same gloo ranks: its source is executed with torch.distributed
as ``deepspeed.comm`` and, for its compiled packer (no CPU build), our ``pack_signs`` / ``unpack_signs`` (the same
bits: ``x >= 0`` → 1, MSB first). Our one-process reference, and so ``CompressedAllReduce`` (matched to it bit for
bit in test_compressed_collectives.py), must give DeepSpeed's result and error buffers over several steps.
Skipped where the 0.19.6 source is not unpacked (DS0196_SRC, default /work/ds0196src)."""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from shardspeed.compression import reference
from shardspeed.compression.signs import pack_signs, padded_numel, unpack_signs

SOURCE = Path(os.environ.get("DS0196_SRC", "/work/ds0196src")) / "deepspeed/runtime/comm/compressed.py"
pytestmark = pytest.mark.skipif(not SOURCE.is_file(), reason=f"DeepSpeed 0.19.6 source not found at {SOURCE}")


class _Packer:
    """DeepSpeed's packbits op interface: ``packbits(float tensor, numel, rank)``, ``unpackbits(bytes, nbytes, rank)``
    (8 ±1 floats per byte)."""

    def packbits(self, tensor: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        return pack_signs(tensor)

    def unpackbits(self, packed: torch.Tensor, nbytes: int, rank: int) -> torch.Tensor:
        return unpack_signs(packed, nbytes * 8)


def _all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> Any:
    """DeepSpeed gathers 0-dim scales into 1-element tensors (NCCL accepts it; gloo wants equal shapes)."""
    return dist.all_gather(tensor_list, tensor.reshape(tensor_list[0].shape), group=group)


def _deepspeed_backend() -> Any:
    """DeepSpeed's ``CompressedBackend`` class, its imports replaced by torch.distributed and the packer above."""
    text = re.sub(r"^(import|from) .*$", "", SOURCE.read_text(), flags=re.MULTILINE)
    builder = types.SimpleNamespace(load=lambda: _Packer())
    namespace: dict[str, Any] = {
        "np": np,
        "torch": torch,
        "dist": types.SimpleNamespace(
            all_gather=_all_gather,
            all_to_all_single=dist.all_to_all_single,
            new_group=dist.new_group,
            get_world_size=dist.get_world_size,
            get_rank=dist.get_rank,
        ),
        "get_accelerator": lambda: types.SimpleNamespace(current_device_name=lambda: "cpu"),
        "PackbitsBuilder": lambda: builder,
        "check_and_handle_empty_buffer": lambda *args: None,
    }
    exec(compile(text, str(SOURCE), "exec"), namespace)
    return namespace["CompressedBackend"]()


def _parity(rank: int, world: int, numel: int, steps: int) -> dict[str, float]:
    backend = _deepspeed_backend()
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
