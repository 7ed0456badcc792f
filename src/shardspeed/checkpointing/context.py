"""``CheckpointingContext``: all activation-checkpointing state of one job, in one explicit object.

It holds the options (``ActivationCheckpointingConfig``), the tensor-parallel axis that
``partition_activations`` splits inputs across, the collectives used to gather them back, the RNG tracker, and
profile totals. Code that can pass objects around (an engine, a model that is handed its context) uses a
context directly; DeepSpeed's module-level functions (``api.py``) delegate to a default one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shardspeed.comm.collectives import Collectives
from shardspeed.config.activation import ActivationCheckpointingConfig
from shardspeed.topology import AxisGroup

from .function import ProfileStats, RegionSettings, checkpoint_non_reentrant, checkpoint_reentrant
from .partition import StoragePlan
from .rng import RNGStatesTracker, follow_tensor_rank, seed_model_parallel


def solo_tensor_axis() -> AxisGroup:
    """A tensor axis of one rank (no tensor parallelism): partitioning is then a no-op."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return AxisGroup("tensor", None, (rank,), 0)


class CheckpointingContext:
    """Options, tensor axis, RNG tracker and profile totals for activation checkpointing.

    ``use_reentrant`` picks the recompute mechanism (see ``function.py``); the default, False, is torch's
    recommended non-reentrant form. ``configured`` only feeds ``is_configured()``: a context made implicitly
    (a module-level call before ``configure``) reports False.
    """

    def __init__(
        self,
        config: ActivationCheckpointingConfig | None = None,
        *,
        tensor_axis: AxisGroup | None = None,
        collectives: Collectives | None = None,
        tracker: RNGStatesTracker | None = None,
        use_reentrant: bool = False,
        configured: bool = True,
    ) -> None:
        if not isinstance(use_reentrant, bool):
            raise TypeError(f"use_reentrant={use_reentrant!r}: expected True or False")
        self.config = config if config is not None else ActivationCheckpointingConfig()
        self.tensor_axis = tensor_axis if tensor_axis is not None else solo_tensor_axis()
        self.collectives = collectives if collectives is not None else Collectives()
        self.tracker = tracker if tracker is not None else RNGStatesTracker()
        self.use_reentrant = use_reentrant
        self.configured = configured
        self.stats: ProfileStats | None = ProfileStats() if self.config.profile else None

    def _settings(self) -> RegionSettings:
        plan = StoragePlan(
            partition=self.config.partition_activations,
            cpu=self.config.cpu_checkpointing,
            contiguous=self.config.contiguous_memory_optimization,
        )
        return RegionSettings(
            plan=plan,
            axis=self.tensor_axis,
            collectives=self.collectives,
            tracker=self.tracker,
            synchronize=self.config.synchronize_checkpoint_boundary,
            stats=self.stats,
        )

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` without keeping its activations; they are recomputed for the backward.

        The result (and every gradient) equals the plain call's, random ops included. Only the top-level tensor
        arguments are stored, in the form the options ask for; with ``partition_activations`` every rank of the
        tensor axis must checkpoint the same regions in the same order (the recompute all-gathers).
        """
        if not callable(function):
            raise TypeError(f"checkpoint(function=...): expected a callable, got {type(function).__name__}")
        run = checkpoint_reentrant if self.use_reentrant else checkpoint_non_reentrant
        return run(function, args, kwargs, self._settings())

    def model_parallel_manual_seed(self, seed: int) -> None:
        """Seed the default device stream with ``seed`` (same on every rank) and the tracker's tensor-parallel
        stream with ``seed + 2718 + tensor rank`` (different per tensor rank). DeepSpeed's
        ``model_parallel_cuda_manual_seed``. Called before the tensor axis is known (the default context before
        ``configure``), the stream is re-seeded for the real tensor rank once it is ([Note: seeding before the
        tensor axis is known] in rng.py)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"model_parallel_manual_seed(seed={seed!r}): expected a non-negative integer")
        seed_model_parallel(self.tracker, seed, self.tensor_axis.rank)

    def use_tensor_axis(self, axis: AxisGroup) -> None:
        """Adopt ``axis`` as this context's tensor axis, re-seeding the model-parallel stream if it was seeded
        for another tensor rank (``initialize`` on a context nobody configured)."""
        self.tensor_axis = axis
        follow_tensor_rank(self.tracker, axis.rank)

    def reset(self) -> None:
        """DeepSpeed's ``reset()``: release buffers a forward without backward would leave behind.

        Nothing is pooled across regions here — each region's stored inputs belong to its autograd graph and are
        freed with it — so this is a no-op; options, axis and RNG states are kept (DeepSpeed's evaluation loops
        call ``reset()`` between forwards and expect checkpointing to stay configured).
        """
