"""``zero_optimization.offload_optimizer`` / ``offload_param``: DeepSpeed's CPU / NVMe offload settings.

Every DeepSpeed key is accepted with DeepSpeed's default so real configs parse. ``offload_optimizer`` with
device "cpu" or "nvme" runs (``shardspeed.offload.optimizer``; of its keys ``nvme_path`` and ``pin_memory`` are
read, the others are tuning knobs with no effect here). ``offload_param`` with device "cpu" or "nvme" runs with
ZeRO stage 3 (``shardspeed.zero.stage3.param_offload``: bf16/fp16 only when it moves anything; ``nvme_path`` and
``pin_memory`` are read, ``buffer_count`` / ``buffer_size`` / ``max_in_cpu`` have no effect).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .base import ConfigModel, NonNegativeInt, PositiveInt

IMPLEMENTED_OFFLOAD_DEVICES: frozenset[str] = frozenset({"none", "cpu", "nvme"})
"""Offload devices shardspeed can run with (``offload_optimizer``, and ``offload_param`` with stage 3)."""

OffloadDevice = Literal["none", "cpu", "nvme"]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class _OffloadCommon(ConfigModel):
    device: OffloadDevice = "none"
    """Where to offload to: "none", "cpu" or "nvme". DeepSpeed default: "none" (no offload)."""

    nvme_path: str | None = None
    """Directory on the NVMe device used when ``device`` is "nvme". DeepSpeed default: null."""

    pin_memory: bool = True
    """Use page-locked host buffers so host<->device copies are asynchronous DMA. DeepSpeed default: true
    (it was false before DeepSpeed changed it)."""


class OffloadParamConfig(_OffloadCommon):
    """``offload_param``: keep ZeRO-3 parameter shards in CPU memory or on NVMe."""

    buffer_count: NonNegativeInt = 5
    """Buffers in the pool used to stage parameters from NVMe. DeepSpeed default: 5."""

    buffer_size: PositiveInt = 100_000_000
    """Elements per NVMe staging buffer. DeepSpeed default: 1e8."""

    max_in_cpu: NonNegativeInt = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe. DeepSpeed default: 1e9."""


class OffloadOptimizerConfig(_OffloadCommon):
    """``offload_optimizer``: keep optimizer state (and run the optimizer step) on the CPU, state
    optionally swapped to NVMe."""

    buffer_count: NonNegativeInt = 4
    """Buffers in the NVMe swap pool; at least the number of per-parameter states the optimizer keeps
    (Adam: parameter, gradient, two moments = 4). DeepSpeed default: 4."""

    fast_init: bool = False
    """Faster optimizer-state initialisation when offloading to NVMe. DeepSpeed default: false."""

    ratio: Fraction = 1.0
    """Fraction of the optimizer step run on the CPU (partial offload, ZeRO-3 only). DeepSpeed default: 1."""

    pipeline_read: bool = False
    """Overlap reading the next NVMe tile with the current tile's step. DeepSpeed default: false."""

    pipeline_write: bool = False
    """Overlap writing the previous NVMe tile with the current tile's step. DeepSpeed default: false."""

    super_offload: bool = False
    """DeepSpeed's "SuperOffload" path for CPU-GPU superchips (ZeRO-3 only). DeepSpeed default: false."""

    convert_grad_on_cpu: bool = True
    """Convert gradients to the optimizer dtype on the CPU rather than the GPU. DeepSpeed default: true."""

    cpuadam_cores_perc: Fraction = 0.8
    """Fraction of CPU cores the CPU optimizer uses under ``super_offload``. DeepSpeed default: 0.8."""
