"""``activation_checkpointing``: DeepSpeed's activation-checkpointing options, typed, with DeepSpeed's defaults.

The section only describes *how* checkpointed regions store and rebuild their inputs; *which* regions are
checkpointed is decided by the model code (``shardspeed.checkpointing.checkpoint`` or the block helpers), as
in DeepSpeed. ``shardspeed.checkpointing.configure`` reads this section; its keyword arguments override it.
"""

from __future__ import annotations

from pydantic import model_validator

from .base import ConfigModel, InvalidValue, PositiveInt


class ActivationCheckpointingConfig(ConfigModel):
    """``activation_checkpointing``: where checkpointed inputs live between forward and recompute."""

    partition_activations: bool = False
    """Split each saved input across the tensor-parallel ranks (each keeps 1/N) and all-gather it for the
    recompute. A no-op when the tensor axis has one rank. DeepSpeed default: false."""

    cpu_checkpointing: bool = False
    """Keep the saved inputs (or their partitions) in host memory and copy them back for the recompute.
    A no-op for inputs already on the CPU. DeepSpeed default: false."""

    contiguous_memory_optimization: bool = False
    """Pack each checkpoint's partitioned inputs into one contiguous buffer instead of one allocation per
    tensor (less allocator fragmentation). Needs ``partition_activations`` and ``number_checkpoints``.
    DeepSpeed default: false."""

    number_checkpoints: PositiveInt | None = None
    """Checkpointed regions per forward pass; DeepSpeed sizes its contiguous buffers with it, so it is
    required with ``contiguous_memory_optimization``. DeepSpeed default: null."""

    synchronize_checkpoint_boundary: bool = False
    """Wait for the accelerator at the start and end of each checkpointed forward and recompute (a
    debugging / timing aid; no effect on the CPU). DeepSpeed default: false."""

    profile: bool = False
    """Time each checkpointed forward and recompute and keep the totals. DeepSpeed default: false."""

    @model_validator(mode="after")
    def _contiguous_needs_partitions(self) -> ActivationCheckpointingConfig:
        # DeepSpeed asserts both rules at configure time; failing at parse time names the key instead.
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise InvalidValue(
                "contiguous_memory_optimization",
                '"{path}" is true but "partition_activations" is false; contiguous buffers hold partitioned '
                'activations, so set "partition_activations": true or turn this off',
            )
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise InvalidValue(
                "number_checkpoints",
                '"{path}" is required when "contiguous_memory_optimization" is true: set it to the number of '
                "checkpointed regions per forward pass",
            )
        return self
