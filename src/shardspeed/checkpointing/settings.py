"""Turning ``configure(...)``'s inputs into one ``ActivationCheckpointingConfig`` and one tensor axis.

``deepspeed_config`` may be a whole DeepSpeed config (dict or JSON path), an already parsed
``ShardSpeedConfig``, or just the ``ActivationCheckpointingConfig``. Only the ``activation_checkpointing``
section is validated here: a whole-config parse would need the data-parallel world size for the batch keys, which
activation checkpointing has no business knowing (the engine validates the rest). Explicit keyword arguments
override the section, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch.distributed as dist
from pydantic import Field, ValidationError

from shardspeed.config.activation import ActivationCheckpointingConfig
from shardspeed.config.base import ConfigModel
from shardspeed.config.errors import ConfigError
from shardspeed.config.load import describe_validation_error, read_config_source
from shardspeed.config.normalize import normalize
from shardspeed.config.root import ShardSpeedConfig
from shardspeed.log import logger
from shardspeed.topology import AxisGroup, Topology

SECTION = "activation_checkpointing"

KWARG_TO_KEY: Mapping[str, str] = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}
"""``configure()``'s keyword arguments (DeepSpeed's names) and the config keys they override."""


class _SectionOnly(ConfigModel):
    """A config with nothing but the activation-checkpointing section, so messages carry its full key path."""

    INTERNAL_FIELDS: ClassVar[frozenset[str]] = frozenset()
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)


def section_from(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The activation-checkpointing section of ``deepspeed_config`` (None means every option off)."""
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, ShardSpeedConfig):
        return deepspeed_config.activation_checkpointing
    raw = read_config_source(deepspeed_config)  # ConfigError for a bad path, bad JSON or a non-dict
    normalized = normalize({SECTION: raw[SECTION]} if SECTION in raw else {}, _SectionOnly)
    for warning in normalized.warnings:  # unknown keys far from every known one: ignored, but not in silence
        logger.warning(warning)
    try:
        return _SectionOnly.model_validate(normalized.data).activation_checkpointing
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, normalized.spellings)) from None


def _checked_override(kwarg: str, value: Any) -> Any:
    if kwarg == "num_checkpoints":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"configure(num_checkpoints={value!r}): expected a positive integer or None")
    elif not isinstance(value, bool):
        raise TypeError(f"configure({kwarg}={value!r}): expected True, False or None (None keeps the config's value)")
    return value


def merged_config(
    section: ActivationCheckpointingConfig, overrides: Mapping[str, Any]
) -> ActivationCheckpointingConfig:
    """``section`` with every non-None keyword argument of ``configure()`` applied on top."""
    updates = {KWARG_TO_KEY[k]: _checked_override(k, v) for k, v in overrides.items() if v is not None}
    if not updates:
        return section
    try:
        return ActivationCheckpointingConfig.model_validate({**section.model_dump(), **updates})
    except ValidationError as error:
        names = ", ".join(f"{kwarg} → {key}" for kwarg, key in KWARG_TO_KEY.items())
        raise ValueError(
            f"configure(): the options conflict after applying keyword arguments: "
            f"{describe_validation_error(error, {})} (keyword arguments override config keys: {names})"
        ) from None


def _call(mpu: Any, *names: str) -> Any:
    """The first of ``names`` that ``mpu`` has, called (Megatron renamed model_parallel → tensor_model_parallel)."""
    for name in names:
        method = getattr(mpu, name, None)
        if callable(method):
            return method()
    raise TypeError(
        f"configure(mpu_=...): {type(mpu).__name__} has none of {', '.join(names)}; pass a Megatron-style mpu, "
        "or a shardspeed Topology as topology=..."
    )


def tensor_axis_from_mpu(mpu: Any) -> AxisGroup:
    """The tensor-parallel axis a Megatron-style ``mpu`` describes."""
    size = int(_call(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size"))
    rank = int(_call(mpu, "get_tensor_model_parallel_rank", "get_model_parallel_rank"))
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    if size == 1:
        return AxisGroup("tensor", None, (global_rank,), 0)
    group = _call(mpu, "get_tensor_model_parallel_group", "get_model_parallel_group")
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) != size or not 0 <= rank < size:
        raise ValueError(
            f"configure(mpu_=...): the mpu reports tensor-parallel world size {size} and rank {rank}, but its group "
            f"holds ranks {ranks}"
        )
    return AxisGroup("tensor", group, ranks, rank)


def tensor_axis_from(mpu: Any, topology: Topology | None) -> AxisGroup | None:
    """The tensor axis from ``topology=`` or ``mpu_`` (a Topology passed as ``mpu_`` is accepted too)."""
    if isinstance(mpu, Topology):
        if topology is not None and topology is not mpu:
            raise ValueError("configure(): pass the topology once, as mpu_ or as topology=, not two different ones")
        topology, mpu = mpu, None
    if topology is not None and mpu is not None:
        raise ValueError("configure(): pass either mpu_ (Megatron-style) or topology= (shardspeed), not both")
    if topology is not None:
        return topology.tensor
    if mpu is not None:
        return tensor_axis_from_mpu(mpu)
    return None
