"""``AioSettings``: the knobs of the NVMe swapper, mirroring DeepSpeed's top-level ``aio`` section.

The config package still lists ``aio`` among the ignored keys (offload is not wired into the engine yet), so
the swapper carries its own small frozen dataclass. The field names and defaults are DeepSpeed's ``aio`` keys;
when the config package grows an ``aio`` section, ``AioSettings.from_mapping`` builds one from that dict.

What each key means in this pure-Python swapper (DeepSpeed's meaning is for libaio; ours is the nearest
equivalent with a thread pool doing positional reads and writes):

- ``block_size``: bytes per I/O request and per staging buffer. Tensors are cut into pieces of this size and
  every swap-file offset is a multiple of it, which also keeps O_DIRECT's alignment rules satisfied.
- ``queue_depth``: how many requests may be in flight at once, i.e. how many staging buffers the pool holds.
- ``thread_count``: threads issuing ``pread``/``pwrite``; each keeps one request in flight.
- ``single_submit``: when true, a tensor's pieces go out one after another on one thread (one request at a
  time, like libaio's one-by-one submission); when false they are spread over all threads.
- ``overlap_events``: when false, every ``swap_in``/``swap_out`` waits for its own I/O before returning (no
  overlap with the caller: simplest to debug); when true they return a handle at once.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

PAGE_SIZE: int = mmap.PAGESIZE
"""Alignment unit of buffers, offsets and lengths: O_DIRECT needs them aligned to the device's logical block
size, which is at most the page size on the filesystems we target."""


@dataclass(frozen=True)
class AioSettings:
    """Asynchronous-I/O settings of a ``TensorSwapper`` (DeepSpeed ``aio`` keys and defaults)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"aio.{name} = {value!r}; valid: a positive integer")
        if self.block_size % PAGE_SIZE:
            raise ValueError(
                f"aio.block_size = {self.block_size}; valid: a positive multiple of the page size ({PAGE_SIZE} bytes),"
                " because O_DIRECT transfers need page-aligned offsets and lengths"
            )
        for name in ("single_submit", "overlap_events"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"aio.{name} = {value!r}; valid: true or false")

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> AioSettings:
        """Build from a DeepSpeed-style ``aio`` dict; an unknown key is an error that names it."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"aio.{unknown[0]} is not an aio setting; valid keys: {', '.join(sorted(known))}")
        return cls(**dict(section))
