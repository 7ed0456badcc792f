"""``zero_optimization.offload_optimizer`` / ``offload_param``: DeepSpeed's CPU / NVMe offload settings.

Every DeepSpeed key is accepted with DeepSpeed's default so real configs parse. ``offload_optimizer`` with
device "cpu" or "nvme" runs (``shardspeed.offload.optimizer``); ``super_offload``,
``convert_grad_on_cpu`` and ``cpuadam_cores_perc`` (DeepSpeed's superchip path) have no effect here: set to a
non-default value, each is one warning (``effects.py``).
``offload_param`` with device "cpu" or "nvme" runs with ZeRO stage 3 (``shardspeed.zero.stage3.param_offload``;
fp32 needs a streamed ``offload_optimizer`` when it moves anything); every key is read, ``buffer_count`` /
``buffer_size`` / ``max_in_cpu`` only when shards go to NVMe.
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

    buffer_count: PositiveInt = 5
    """Device "nvme": host buffers that parameter shards are read into from NVMe, reused (page-aligned, allocated
    as needed); shards needed at once beyond this (deep prefetch) get temporary buffers, with a warning saying
    what count avoids them. At least 1. DeepSpeed default: 5."""

    buffer_size: PositiveInt = 100_000_000
    """Device "nvme": elements per buffer (of the parameters' dtype); it must hold the largest shard that goes to
    NVMe (one rank's slice of a ZeRO-3 unit), else a ConfigError names that unit. Buffers are allocated only as
    large as that shard. Host memory for shards read from NVMe stays within buffer_count x buffer_size elements.
    DeepSpeed default: 1e8."""

    max_in_cpu: NonNegativeInt = 1_000_000_000
    """Device "nvme": per-rank parameter shard elements kept in host memory instead of NVMe: the leading ZeRO-3
    units, in order, while their shards add up to at most this; the rest go to NVMe. DeepSpeed default: 1e9,
    which keeps every model under 1e9 elements per rank entirely in host memory; 0 sends everything to NVMe."""


class OffloadOptimizerConfig(_OffloadCommon):
    """``offload_optimizer``: keep optimizer state (and run the optimizer step) on the CPU, state
    optionally swapped to NVMe."""

    buffer_count: Annotated[int, Field(ge=3)] = 9
    """Chunk-sized (``sub_group_size``) fp32 host buffers the NVMe stream uses. Each sub-group in flight takes
    three (its fp32 values and Adam's two moments; the gradient stays where the reduction left it), so
    ``buffer_count // 3`` sub-groups are in host memory at once; 9 lets reading the next, stepping this one and
    writing the previous overlap. Fewer than 3 is an error. DeepSpeed default: 4 (it counts the gradient as a
    fourth buffer); ours is 9, a deliberate difference, so the default overlaps I/O with the step."""

    fast_init: bool = False
    """Write only the fp32 values to NVMe at start; Adam's zero moments are not written but read as zeros until
    the first step writes them (a third of the start-up I/O, and the first step reads a third). DeepSpeed
    default: false."""

    ratio: Fraction = 1.0
    """Fraction of the optimizer state offloaded, in whole sub-groups from the first: the rest keeps its moments
    on the training device and is stepped there (DeepSpeed: ZeRO-3 only; here stages 1-3). With ``device:
    "cpu"`` on a machine without an accelerator everything is already in host memory and it has no effect.
    DeepSpeed default: 1."""

    pipeline_read: bool = True
    """Read the next sub-groups from NVMe while the current one is stepped (as far as ``buffer_count`` allows).
    DeepSpeed default: false; ours is true (deliberate: overlap by default)."""

    pipeline_write: bool = True
    """Write a stepped sub-group back to NVMe while the next ones are stepped. DeepSpeed default: false; ours is
    true (deliberate)."""

    offload_gradients: bool = True
    """shardspeed only. ZeRO-3 with ``device: "nvme"`` (and ``ratio`` 1): each unit's reduced fp32 gradient shard
    is written behind to the swap file as its reduce-scatter completes and freed, and the streamed step reads it
    back with the states (ZeRO-Infinity's bound: host memory independent of model size; zero/stage3/
    grad_offload.py). False keeps the gradient shards in host memory (4 bytes per parameter / N). Stages 1/2 keep
    their gradients in memory either way."""

    super_offload: bool = False
    """DeepSpeed's "SuperOffload" path for CPU-GPU superchips (ZeRO-3 only). DeepSpeed default: false."""

    convert_grad_on_cpu: bool = True
    """Convert gradients to the optimizer dtype on the CPU rather than the GPU. DeepSpeed default: true."""

    cpuadam_cores_perc: Fraction = 0.8
    """Fraction of CPU cores the CPU optimizer uses under ``super_offload``. DeepSpeed default: 0.8."""
