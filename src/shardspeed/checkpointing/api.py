"""DeepSpeed's module-level activation-checkpointing functions, delegating to one default context.

Why any module-level state at all, when the rest of shardspeed passes its state explicitly: DeepSpeed's API is
module-level (``deepspeed.checkpointing.configure(...)`` once, then ``checkpoint(...)`` deep inside model code,
and ``get_cuda_rng_tracker()`` wherever dropout runs), and Megatron-style models call it that way. So there is
exactly one piece of it — ``_DEFAULT.context`` below — and everything else lives in the ``CheckpointingContext``
it points to. Code that can pass a context around should: ``CheckpointingContext(...).checkpoint(...)`` touches
no module state. ``set_default_context(None)`` removes the default (tests do this between cases).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardspeed.comm.collectives import Collectives
from shardspeed.topology import Topology

from .context import CheckpointingContext
from .rng import RNGStatesTracker, follow_tensor_rank
from .settings import merged_config, section_from, tensor_axis_from


class _DefaultSlot:
    """Holds the default context; the only module-level state of the package."""

    context: CheckpointingContext | None = None


_DEFAULT = _DefaultSlot()


def default_context() -> CheckpointingContext:
    """The context the module-level functions use; made on first use (unconfigured, all options off)."""
    if _DEFAULT.context is None:
        _DEFAULT.context = CheckpointingContext(configured=False)
    return _DEFAULT.context


def set_default_context(context: CheckpointingContext | None) -> None:
    """Install ``context`` as the default (None removes it, and the next use starts an unconfigured one)."""
    if context is not None and not isinstance(context, CheckpointingContext):
        raise TypeError(f"set_default_context: expected a CheckpointingContext or None, got {type(context).__name__}")
    _DEFAULT.context = context


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    topology: Topology | None = None,
    use_reentrant: bool = False,
    collectives: Collectives | None = None,
) -> CheckpointingContext:
    """Configure activation checkpointing (DeepSpeed's signature, plus shardspeed keyword-only extras).

    ``mpu_``: a Megatron-style object (``get_[tensor_]model_parallel_rank/world_size/group``) naming the
    tensor-parallel group, or a shardspeed ``Topology``; ``topology=`` is the neutral spelling of the latter.
    ``deepspeed_config``: a DeepSpeed config dict or JSON path (only ``activation_checkpointing`` is read), a
    ``ShardSpeedConfig``, or an ``ActivationCheckpointingConfig``. The other arguments override the config
    (None keeps it): ``contiguous_checkpointing`` → ``contiguous_memory_optimization``, ``num_checkpoints`` →
    ``number_checkpoints``, ``checkpoint_in_cpu`` → ``cpu_checkpointing``, ``synchronize`` →
    ``synchronize_checkpoint_boundary``. The RNG tracker's states survive reconfiguration. Returns the new
    default context.
    """
    config = merged_config(
        section_from(deepspeed_config),
        {
            "partition_activations": partition_activations,
            "contiguous_checkpointing": contiguous_checkpointing,
            "num_checkpoints": num_checkpoints,
            "checkpoint_in_cpu": checkpoint_in_cpu,
            "synchronize": synchronize,
            "profile": profile,
        },
    )
    previous = _DEFAULT.context
    context = CheckpointingContext(
        config,
        tensor_axis=tensor_axis_from(mpu_, topology),
        collectives=collectives,
        tracker=previous.tracker if previous is not None else None,
        use_reentrant=use_reentrant,
    )
    follow_tensor_rank(context.tracker, context.tensor_axis.rank)  # seeded before the axis was known
    _DEFAULT.context = context
    return context


def adopt_topology(topology: Topology) -> None:
    """What ``initialize`` does when the config does not configure activation checkpointing: a default context
    that exists but was never configured takes the engine's tensor axis, so a ``model_parallel_manual_seed`` that
    ran before it (every tensor rank seeded as rank 0) is re-seeded for this rank ([Note: seeding before the
    tensor axis is known] in rng.py). Its options stay off and ``is_configured()`` stays False; a configured
    context is left alone (its user chose its axis)."""
    context = _DEFAULT.context
    if context is not None and not context.configured:
        context.use_tensor_axis(topology.tensor)


def existing_rng_tracker() -> RNGStatesTracker | None:
    """The default context's tracker if a default context exists (never makes one): what checkpoints save."""
    return _DEFAULT.context.tracker if _DEFAULT.context is not None else None


def is_configured() -> bool:
    """True once ``configure()`` has run (and until the default context is removed)."""
    return _DEFAULT.context is not None and _DEFAULT.context.configured


def reset() -> None:
    """DeepSpeed's ``reset()``: free buffers left by forwards without a backward (see ``CheckpointingContext.reset``).
    Configuration and RNG states are kept; ``set_default_context(None)`` forgets them."""
    if _DEFAULT.context is not None:
        _DEFAULT.context.reset()


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` as a checkpointed region of the default context (non-reentrant unless
    ``configure(use_reentrant=True)``). See ``CheckpointingContext.checkpoint``."""
    return default_context().checkpoint(function, *args, **kwargs)


def get_rng_tracker() -> RNGStatesTracker:
    """The default context's RNG tracker (``with get_rng_tracker().fork(): ...`` for tensor-parallel dropout)."""
    return default_context().tracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default context's streams; see ``CheckpointingContext.model_parallel_manual_seed``."""
    default_context().model_parallel_manual_seed(seed)


# DeepSpeed's (CUDA-named) spellings of the two functions above; they drive the CPU generator on CPU-only hosts.
get_cuda_rng_tracker = get_rng_tracker
model_parallel_cuda_manual_seed = model_parallel_manual_seed
