"""How much NVMe I/O to keep in flight, from a short measurement of the disk and of CPU Adam.

[Note: stream sizing] A streamed step moves every chunk (``sub_group_size`` elements, n) through host memory: it
reads its states (and, with gradients in the store, its gradient: ``s`` fp32 tensors of n), Adam steps it, and it
writes its three states back. Per chunk the disk needs ``t_io = 4n·s / read_bps + 12n / write_bps`` and the CPU
``t_adam = n / adam_eps`` (elements per second). One disk serves reads and writes, so:

- ``t_io ≤ t_adam`` (the CPU is the bottleneck): reading one chunk ahead and writing one behind hides all I/O;
  more buffers would only hold memory. Read-ahead 1.
- ``t_io > t_adam`` (the disk must be the bottleneck): the step can go no faster than the disk, and what matters
  is that the disk never idles, so enough reads are queued to cover the ratio: read-ahead ``ceil(t_io / t_adam)``,
  capped at ``MAX_READ_AHEAD`` (beyond a few requests a device queue is saturated; NVMe also gains bandwidth from
  queue depth up to there).

Buffer sets are read-ahead + 2 (the chunk being stepped and the one being written behind), so host memory is
``(read_ahead + 2) × s × 4n`` bytes whatever the model size. The gradient write-behind during backward
(grad_swap.py) may hold ``write_bps × WRITE_BEHIND_S`` bytes in flight, clamped to [``MIN_WINDOW``,
``MAX_WINDOW``] and to two of the largest stepped tensors (a unit's gradient shard; never below ``MIN_WINDOW``):
a tenth of a second of disk writes keeps the disk busy through the gaps between units, two units in flight are
enough for that (they are written one after another), and gradients never accumulate when the disk is slower
than backward.

DeepSpeed's ``buffer_count`` / ``pipeline_read`` / ``pipeline_write`` still win when the config sets them
(``sized_offload_config`` only fills the fields the config did not set: pydantic's ``model_fields_set``).

The measurement (``measure``): write then read ``PROBE_BYTES`` with O_DIRECT where the filesystem allows it (else
buffered, then dropped from the page cache) in the swap directory, and time CPU Adam on one chunk-sized step; cached
per directory for the process. It takes a few tens of milliseconds; any error leaves the defaults in place.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardspeed.config.offload import OffloadOptimizerConfig

from .aligned import PRIVATE_ANONYMOUS

PROBE_BYTES = 8 << 20
MAX_READ_AHEAD = 4
WRITE_BEHIND_S = 0.1
MIN_WINDOW = 16 << 20
MAX_WINDOW = 256 << 20
ADAM_PROBE_NUMEL = 1 << 20


@dataclass(frozen=True)
class DiskRates:
    """Measured throughputs: the disk's in bytes per second, CPU Adam's in elements per second."""

    read_bps: float
    write_bps: float
    adam_eps: float


@dataclass(frozen=True)
class StreamSizing:
    """What [Note: stream sizing] chooses: the streamed step's buffers and the gradient write-behind window."""

    read_ahead: int
    buffer_count: int  # chunk-sized buffers: (read_ahead + 2) sets of ``per_chunk``
    grad_window_bytes: int
    disk_bound: bool


def size_stream(
    rates: DiskRates, chunk_numel: int, grads_in_store: bool, largest_tensor_bytes: int | None = None
) -> StreamSizing:
    """[Note: stream sizing], pure. ``largest_tensor_bytes``: the largest stepped tensor (caps the window)."""
    if min(rates.read_bps, rates.write_bps, rates.adam_eps) <= 0 or chunk_numel < 1:
        raise ValueError(f"rates must be positive and chunk_numel >= 1, got {rates}, {chunk_numel}")
    reads = 4 if grads_in_store else 3
    t_io = 4 * chunk_numel * reads / rates.read_bps + 12 * chunk_numel / rates.write_bps
    t_adam = chunk_numel / rates.adam_eps
    disk_bound = t_io > t_adam
    read_ahead = min(MAX_READ_AHEAD, math.ceil(t_io / t_adam)) if disk_bound else 1
    window = int(min(MAX_WINDOW, max(MIN_WINDOW, rates.write_bps * WRITE_BEHIND_S)))
    if largest_tensor_bytes is not None:
        window = min(window, max(MIN_WINDOW, 2 * largest_tensor_bytes))
    return StreamSizing(read_ahead, (read_ahead + 2) * 3, window, disk_bound)


def sized_offload_config(offload: OffloadOptimizerConfig, sizing: StreamSizing | None) -> OffloadOptimizerConfig:
    """``offload`` with ``buffer_count`` / ``pipeline_read`` / ``pipeline_write`` from ``sizing`` where the config
    did not set them (``model_fields_set``); unchanged without a measurement."""
    if sizing is None:
        return offload
    update: dict[str, object] = {}
    explicit = offload.model_fields_set
    if "buffer_count" not in explicit:
        update["buffer_count"] = sizing.buffer_count
    if "pipeline_read" not in explicit:
        update["pipeline_read"] = True
    if "pipeline_write" not in explicit:
        update["pipeline_write"] = True
    return offload.model_copy(update=update) if update else offload


_CACHE: dict[str, DiskRates] = {}
"""Measured rates per swap directory, for this process (a probe is cheap, but once is enough)."""


def measure(directory: str | os.PathLike[str]) -> DiskRates | None:
    """The disk's read/write bandwidth in ``directory`` and CPU Adam's rate (cached per directory); None when the
    probe cannot run (then the configured sizes apply)."""
    key = str(Path(directory).resolve())
    if key in _CACHE:
        return _CACHE[key]
    try:
        read_bps, write_bps = _disk_rates(Path(directory))
        rates = DiskRates(read_bps, write_bps, _adam_rate())
    except OSError:
        return None
    _CACHE[key] = rates
    return rates


def _disk_rates(directory: Path) -> tuple[float, float]:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".bandwidth_probe-{os.getpid()}"
    buffer = mmap.mmap(-1, PROBE_BYTES, flags=PRIVATE_ANONYMOUS)  # page aligned: O_DIRECT can use it in place
    buffer.write(os.urandom(4096) * (PROBE_BYTES // 4096))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | direct, 0o600)
    except OSError:
        direct = 0
        fd = os.open(probe, os.O_CREAT | os.O_RDWR, 0o600)
    probe.unlink()  # like the swap file: nothing is left by name, even if killed
    try:
        start = time.perf_counter()
        os.pwrite(fd, buffer, 0)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        if not direct:
            os.posix_fadvise(fd, 0, PROBE_BYTES, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        os.preadv(fd, [buffer], 0)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        buffer.close()
    return PROBE_BYTES / max(read_s, 1e-6), PROBE_BYTES / max(write_s, 1e-6)


def _adam_rate() -> float:
    from .cpu_adam import cpu_adamw_step

    param, grad = torch.zeros(ADAM_PROBE_NUMEL), torch.full((ADAM_PROBE_NUMEL,), 1e-3)
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    start = time.perf_counter()
    cpu_adamw_step(param, grad, m, v, step=1, lr=1e-3, chunk_numel=ADAM_PROBE_NUMEL)
    return ADAM_PROBE_NUMEL / max(time.perf_counter() - start, 1e-6)
