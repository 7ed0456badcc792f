"""Page-aligned host memory for the swapper: buffers O_DIRECT can read into and write from in place."""

from __future__ import annotations

import mmap

import torch

from .aio_config import PAGE_SIZE

# Buffers are private anonymous mappings: Python's default for mmap(-1, ...) is MAP_SHARED, which the kernel
# accounts as shared memory (RssShmem), so a process's anonymous-memory figure (RssAnon) would not show them.
PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ≥ ``value``."""
    return -(-value // multiple) * multiple


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D tensor in page-aligned memory (anonymous mmap), padded to whole pages.

    With O_DIRECT the swapper reads and writes such tensors in place (no staging copy) as long as each block
    of the transfer is whole pages; other tensors go through the staging buffers. Use it for long-lived swap
    buffers (``stream_step`` does). A fresh anonymous mapping reads as zeros (the kernel zero-fills each page on
    first touch) and becomes resident memory only as it is touched; ZeRO-3 gradient shards rely on both.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(round_up(numel * itemsize, PAGE_SIZE), PAGE_SIZE), flags=PRIVATE_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8)[: numel * itemsize].view(dtype)
