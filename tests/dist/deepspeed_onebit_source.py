"""DeepSpeed 0.19.6's 1-bit sources (the last release with them) executed over torch.distributed, for parity tests.

DeepSpeed's ``CompressedBackend`` (runtime/comm/compressed.py) and ``OnebitAdam`` (runtime/fp16/onebit/adam.py) are
compiled from their unpacked source with every import line replaced: ``deepspeed.comm`` becomes torch.distributed,
the compiled packer (no CPU build) our ``pack_signs`` / ``unpack_signs`` (the same bits: ``x >= 0`` → 1, MSB
first), the accelerator a CPU stub. Nothing of DeepSpeed is imported, so this runs in the main venv; the tests skip
where the source is not unpacked (DS0196_SRC, default /work/ds0196src)."""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardspeed.compression.signs import pack_signs, unpack_signs

ROOT = Path(os.environ.get("DS0196_SRC", "/work/ds0196src"))
COMPRESSED = ROOT / "deepspeed/runtime/comm/compressed.py"
ONEBIT_ADAM = ROOT / "deepspeed/runtime/fp16/onebit/adam.py"


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


_DIST = types.SimpleNamespace(
    all_gather=_all_gather,
    all_to_all_single=dist.all_to_all_single,
    new_group=dist.new_group,
    get_world_size=dist.get_world_size,
    get_rank=dist.get_rank,
    is_initialized=dist.is_initialized,
)
_ACCELERATOR = types.SimpleNamespace(current_device_name=lambda: "cpu", empty_cache=lambda: None)


def _exec(source: Path, names: dict[str, Any]) -> dict[str, Any]:
    """Run ``source`` with every import line (top-level or inside a function) replaced by ``pass``, in a namespace
    holding ``names``."""
    text = re.sub(r"^(\s*)(import|from) .*$", r"\1pass", source.read_text(), flags=re.MULTILINE)
    namespace = {"np": np, "torch": torch, "types": types, "dist": _DIST, "get_accelerator": lambda: _ACCELERATOR}
    namespace.update(names)
    exec(compile(text, str(source), "exec"), namespace)
    return namespace


def compressed_backend_class() -> type:
    """DeepSpeed's ``CompressedBackend`` class."""
    builder = types.SimpleNamespace(load=lambda: _Packer())
    names = {"PackbitsBuilder": lambda: builder, "check_and_handle_empty_buffer": lambda *args: None}
    return _exec(COMPRESSED, names)["CompressedBackend"]


def onebit_adam_class() -> type:
    """DeepSpeed's ``OnebitAdam`` class; construct it with ``comm_backend_name="compressed"`` (its backend is the
    class above) and ``deepspeed=`` a namespace with ``mpu=None, local_rank=0``."""
    names = {"CompressedBackend": compressed_backend_class(), "required_torch_version": lambda **kw: True}
    return _exec(ONEBIT_ADAM, names)["OnebitAdam"]
