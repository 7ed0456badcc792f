"""Opening a swap file on every data-parallel rank at once: a path unusable on one rank fails all of them.

Opening one also pins glibc's mmap threshold (``malloc.pin_mmap_threshold``): NVMe offload is where bounded host
memory is the point, and without the pin the allocator's dynamic threshold lets freed step buffers pile up in
the heap."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.malloc import pin_mmap_threshold
from shardspeed.offload.swapper import SwapSetupError, TensorSwapper


def open_swapper_on_every_rank(
    nvme_path: str,
    capacity: Callable[[], int],
    settings: AioSettings,
    *,
    key: str,
    job_prefix: str,
    rank: int,
    agree: Callable[[object], list[object]],
) -> TensorSwapper:
    """A swapper whose file is created (and at once unlinked) under ``nvme_path/<job>-rank<r>``. Collective:
    ``agree`` all-gathers a small object over the data-parallel ranks; they share one job id, and every rank
    learns whether any rank failed (so all raise the same SwapSetupError naming ``key`` and the first failing
    rank, and nobody is left with a directory). Pins glibc's mmap threshold first (repeating that is harmless;
    skipped if the user set it themselves)."""
    pin_mmap_threshold()
    job = agree(f"{job_prefix}-{uuid.uuid4().hex[:12]}")[0]
    swapper: TensorSwapper | None = None
    problem: str | None = None
    try:
        swapper = TensorSwapper(nvme_path, capacity(), settings, job_id=f"{job}-rank{rank}")
    except (SwapSetupError, OSError) as error:
        problem = str(error)
    problems = [(r, p) for r, p in enumerate(agree(problem)) if p is not None]
    if problems:
        if swapper is not None:
            swapper.abort()
        where, first = problems[0]
        raise SwapSetupError(f"{key} = {nvme_path!r} is unusable on data-parallel rank {where}: {first}")
    assert swapper is not None
    return swapper
