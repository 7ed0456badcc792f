"""``deepspeed.runtime.utils``: the helpers training scripts import from it.

``set_random_seed`` (random, numpy when installed, torch), ``see_memory_usage`` (rank 0 logs the accelerator's
memory figures when ``force``), ``move_to_device`` / ``copy_to_device`` (nested containers), ``partition_uniform``
(DeepSpeed's CSR-style split points), ``get_global_norm``, ``noop_context``, ``ensure_directory_exists``.
"""

from __future__ import annotations

import gc
import math
import os
import random
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch

noop_context = nullcontext


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold ``filename``."""
    directory = os.path.dirname(filename)
    if directory:
        os.makedirs(directory, exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator (when numpy is installed) and torch (all devices)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for shardspeed
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


def _map_tensors(item: Any, convert: Callable[[Any], Any], criterion_func: Callable[[Any], bool]) -> Any:
    if criterion_func(item):
        return convert(item)
    if isinstance(item, list):
        return [_map_tensors(value, convert, criterion_func) for value in item]
    if isinstance(item, tuple):
        return tuple(_map_tensors(value, convert, criterion_func) for value in item)
    if isinstance(item, dict):
        return {key: _map_tensors(value, convert, criterion_func) for key, value in item.items()}
    return item


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """A copy of ``item`` with every element matching ``criterion_func`` (nested lists/tuples/dicts) on ``device``."""
    return _map_tensors(item, lambda tensor: tensor.to(device), criterion_func)


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """Like ``copy_to_device``, but each matching tensor keeps its identity: its storage moves (``.data``)."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        tensor.data = tensor.data.to(device)
        return tensor

    return _map_tensors(item, move, criterion_func)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` split points of ``num_items`` items (part p is ``[parts[p], parts[p+1])``): sizes differ by
    at most one and the first ``num_items % num_parts`` parts get the extra item. With fewer items than parts,
    the first parts get one item each and the rest none."""
    if num_parts < 1:
        raise ValueError(f"partition_uniform: num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(part, num_items) for part in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [part * size + min(part, extra) for part in range(num_parts + 1)]


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The L2 norm of the concatenation of pieces whose L2 norms are ``norm_list``."""
    return math.sqrt(sum(float(norm) ** 2 for norm in norm_list))


def see_memory_usage(message: str, force: bool = False) -> None:
    """When ``force``: on rank 0 (or without a process group), log ``message`` and the accelerator's memory
    figures in GB (allocated, max allocated, reserved, max reserved). Without ``force``: nothing (DeepSpeed's
    convention, so calls can stay in the code)."""
    if not force:
        return
    import torch.distributed as dist

    from shardspeed.accelerator import get_accelerator
    from shardspeed.utils.logging import logger

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # Python frees lazily; collect first so the figures are not inflated by garbage
    accelerator = get_accelerator()
    gigabyte = 1024**3
    logger.info(message)
    logger.info(
        "MA %.2f GB  Max_MA %.2f GB  CA %.2f GB  Max_CA %.2f GB",
        accelerator.memory_allocated() / gigabyte,
        accelerator.max_memory_allocated() / gigabyte,
        accelerator.memory_reserved() / gigabyte,
        accelerator.max_memory_reserved() / gigabyte,
    )


__all__ = [
    "copy_to_device",
    "ensure_directory_exists",
    "get_global_norm",
    "move_to_device",
    "noop_context",
    "partition_uniform",
    "see_memory_usage",
    "set_random_seed",
]
