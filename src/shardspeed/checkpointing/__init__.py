"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``): keep only the inputs of
checkpointed regions and recompute their activations in the backward, with exactly the same random numbers.

Module map: ``api`` (DeepSpeed's module-level functions and the one default context), ``context``
(``CheckpointingContext``: options, tensor axis, RNG tracker), ``function`` (the non-reentrant and reentrant
recompute), ``partition`` (how saved inputs are stored: as is, in host memory, or split over the tensor axis),
``rng`` (the tensor-parallel RNG tracker and RNG snapshots), ``settings`` (configure()'s inputs → options),
``blocks`` (checkpoint every k-th block of a stack).

Typical use, as in DeepSpeed::

    from shardspeed import checkpointing
    checkpointing.configure(topology=topology, deepspeed_config=ds_config)   # or mpu_=megatron_mpu
    checkpointing.model_parallel_cuda_manual_seed(1234)
    ...
    hidden = checkpointing.checkpoint(block, hidden, attention_mask)
"""

from __future__ import annotations

from .api import (
    adopt_topology,
    checkpoint,
    configure,
    default_context,
    existing_rng_tracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    reset,
    set_default_context,
)
from .blocks import CheckpointedSequential, checkpoint_sequential, run_blocks
from .context import CheckpointingContext
from .function import CheckpointFunction, ProfileStats
from .rng import MODEL_PARALLEL_RNG, RNGStatesTracker, seed_model_parallel

CudaRNGStatesTracker = RNGStatesTracker
"""DeepSpeed's name for the tracker class (it tracks the CPU generator on CPU-only hosts)."""

non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant; here ``checkpoint`` is non-reentrant by default."""

__all__ = [
    "MODEL_PARALLEL_RNG",
    "CheckpointFunction",
    "CheckpointedSequential",
    "CheckpointingContext",
    "CudaRNGStatesTracker",
    "ProfileStats",
    "RNGStatesTracker",
    "adopt_topology",
    "checkpoint",
    "checkpoint_sequential",
    "configure",
    "default_context",
    "existing_rng_tracker",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "run_blocks",
    "seed_model_parallel",
    "set_default_context",
]
