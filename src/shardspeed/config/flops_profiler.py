"""``flops_profiler``: DeepSpeed's FLOPs profiler section (DeepSpeed 0.19.8 ``profiling/config.py`` and
``profiling/constants.py``: same keys, same defaults). Read by ``shardspeed.profiling.engine_profiler``."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .base import ConfigModel, Int, NonNegativeFloat, NonNegativeInt

ModuleDepth = Annotated[Int, Field(ge=-1)]


class FlopsProfilerConfig(ConfigModel):
    """``flops_profiler``: profile one training step (parameters, MACs/FLOPs and latency per module) and print
    DeepSpeed's summary; the engine's ``flops_profiler`` then knows the model FLOPs per sample (MFU)."""

    enabled: bool = False
    """Profile step ``profile_step``. DeepSpeed default: false."""

    recompute_fwd_factor: NonNegativeFloat = 0.0
    """Share of the forward recomputed in backward (activation checkpointing: 1.0 for full recompute); the
    hardware FLOPs lines count ``(3 + factor) × fwd flops`` as DeepSpeed does. DeepSpeed default: 0.0."""

    profile_step: NonNegativeInt = 1
    """Profile the step taken after this many optimizer steps (DeepSpeed compares it with ``global_steps``, so 1
    is the second step: the first one warms up). DeepSpeed default: 1."""

    module_depth: ModuleDepth = -1
    """Depth of the per-depth aggregated tables; -1: every depth. DeepSpeed default: -1."""

    top_modules: NonNegativeInt = 1
    """Modules listed per depth in the aggregated tables. DeepSpeed default: 1."""

    detailed: bool = True
    """Print the per-module tree. DeepSpeed default: true."""

    output_file: str | None = None
    """Write the summary to this file (rank 0) instead of only printing it. DeepSpeed default: none (stdout)."""
