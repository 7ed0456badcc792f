"""``offload_optimizer(...)``: wrap the engine's torch Adam/AdamW for ``zero_optimization.offload_optimizer``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardspeed.config.offload import OffloadOptimizerConfig

from .aio_config import AioSettings
from .disk_probe import MIN_WINDOW, measure, size_stream, sized_offload_config
from .host_store import HostStore
from .optimizer import StreamedAdam, check_streamable
from .setup import open_swapper_on_every_rank
from .stepped_access import SteppedAccess
from .stream import plan_pipeline
from .swapper import TensorSwapper


def offload_optimizer(
    inner: torch.optim.Optimizer,
    offload: OffloadOptimizerConfig,
    *,
    settings: AioSettings,
    chunk_numel: int,
    rank: int,
    agree: Callable[[object], list[object]],
    access: SteppedAccess | None = None,
    values_in_store: bool = False,
    offload_grads: bool = False,
) -> torch.optim.Optimizer | StreamedAdam:
    """Wrap ``inner`` for the ``offload_optimizer`` section; collective over the data-parallel ranks (``agree``
    is their all-gather of a small object), so a rank whose ``nvme_path`` is unusable fails every rank at once.

    "cpu" on a CPU-only machine returns ``inner`` itself: its states are already in host memory (``ratio``,
    ``buffer_count`` and the pipeline flags then have nothing to act on). ``access``: how the stepped tensors'
    values are reached (``StreamedAdam``), for a stage whose tensors are stand-ins; ``values_in_store``: the
    stage handed its fp32 masters over (``StreamedAdam``). ``offload_grads``: with ``device: "nvme"``, the swap
    file also holds every chunk's gradient (grad_swap.py). With ``device: "nvme"`` the disk and CPU Adam are
    measured once (disk_probe.py, [Note: stream sizing]) and size the stream where the config did not.
    """
    device = offload.device
    if device == "none" or (device == "cpu" and not _has_accelerator(inner) and not values_in_store):
        return inner
    check_streamable(inner)
    if device == "cpu":
        host = lambda: HostStore(offload.pin_memory)  # noqa: E731
        return StreamedAdam(inner, host(), chunk_numel, access, offload, values_in_store, reopen=host)
    if device != "nvme":
        raise ValueError(f"offload_optimizer.device = {device!r}; valid: none, cpu, nvme")
    assert offload.nvme_path is not None
    plan_pipeline(offload.buffer_count, offload.pipeline_read, offload.pipeline_write)  # before any collective
    nvme_path = offload.nvme_path
    largest = max((t.numel() for g in inner.param_groups for t in g["params"]), default=1)
    rates = measure(nvme_path)  # local: every rank sizes its own stream (nothing here must agree)
    chunk = max(1, min(chunk_numel, largest))
    sizing = size_stream(rates, chunk, offload_grads, 4 * largest) if rates is not None else None
    offload = sized_offload_config(offload, sizing)
    grad_window_bytes = (sizing.grad_window_bytes if sizing is not None else MIN_WINDOW) if offload_grads else None

    def open_swapper() -> TensorSwapper:
        """A swap file sized for ``inner``'s tensors as they are now (re-opened after a bucket re-layout)."""
        return open_swapper_on_every_rank(
            nvme_path,
            lambda: StreamedAdam.bytes_needed(
                inner, chunk_numel, settings, offload.ratio, grads=grad_window_bytes is not None
            ),
            settings,
            key="zero_optimization.offload_optimizer.nvme_path",
            job_prefix="shardspeed",
            rank=rank,
            agree=agree,
        )

    swapper = open_swapper()
    try:
        return StreamedAdam(
            inner,
            swapper,
            chunk_numel,
            access,
            offload,
            values_in_store,
            reopen=open_swapper,
            agree=agree,
            grad_window_bytes=grad_window_bytes,
        )
    except BaseException:
        swapper.abort()
        raise


def _has_accelerator(inner: torch.optim.Optimizer) -> bool:
    return any(t.device.type != "cpu" for group in inner.param_groups for t in group["params"])
