"""``deepspeed.runtime.config.DeepSpeedConfig``: a DeepSpeed config parsed into shardspeed's typed config, read
through DeepSpeed's attribute names.

``DeepSpeedConfig(config, mpu=None, mesh_device=None)`` takes a dict or a JSON path, resolves the batch keys for
the data-parallel world size (``mpu``'s data-parallel group, else the process group's size, else 1) and
validates with ``load_config`` — the same parse ``initialize`` does, so the same errors. ``.config`` is the typed
``ShardSpeedConfig``; the attributes below are DeepSpeed's names for its fields. Only the cheap, commonly read
ones are provided; any other attribute is an ``AttributeError`` naming the typed config to read instead.
"""

from __future__ import annotations

from typing import Any

from shardspeed.config import ConfigError, ConfigSource, ShardSpeedConfig, load_config
from shardspeed.config.load import read_config_source

DeepSpeedConfigError = ConfigError


def _dp_world_size(config: dict[str, Any], mpu: Any) -> int:
    """The data-parallel size the batch keys are resolved for: the mpu's, else the world divided by
    ``tensor_parallel.autotp_size`` (as ``initialize`` resolves the mesh)."""
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    import torch.distributed as dist

    from shardspeed.mesh import resolve_mesh

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return resolve_mesh(config, world).data


class DeepSpeedConfig:
    """DeepSpeed's config object over a validated ``ShardSpeedConfig`` (``.config``)."""

    def __init__(self, config: ConfigSource, mpu: Any = None, mesh_device: Any = None) -> None:
        if mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig: mesh_device (sequence-parallel meshes) is not implemented yet")
        self._param_dict = read_config_source(config)
        self.world_size = _dp_world_size(self._param_dict, mpu)
        self.config: ShardSpeedConfig = load_config(self._param_dict, dp_world_size=self.world_size)
        typed = self.config
        self.train_batch_size = typed.train_batch_size
        self.train_micro_batch_size_per_gpu = typed.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = typed.gradient_accumulation_steps
        self.steps_per_print = typed.steps_per_print
        self.gradient_clipping = typed.gradient_clipping
        self.prescale_gradients = typed.prescale_gradients
        self.gradient_predivide_factor = typed.gradient_predivide_factor
        self.wall_clock_breakdown = typed.wall_clock_breakdown
        self.seed = typed.seed
        self.zero_config = typed.zero_optimization
        self.zero_optimization_stage = typed.zero_optimization.stage
        self.zero_enabled = typed.zero_optimization.stage > 0
        self.zero_allow_untested_optimizer = typed.zero_allow_untested_optimizer
        self.fp16_enabled = typed.fp16.enabled
        self.fp16_auto_cast = typed.fp16.auto_cast
        self.bfloat16_enabled = typed.bf16.enabled
        self.bf16_enabled = typed.bf16.enabled
        self.loss_scale = typed.fp16.loss_scale
        self.initial_dynamic_scale = 2**typed.fp16.initial_scale_power
        self.optimizer_name = typed.optimizer.type if typed.optimizer is not None else None
        self.optimizer_params = dict(typed.optimizer.params) if typed.optimizer is not None else None
        self.scheduler_name = typed.scheduler.type if typed.scheduler is not None else None
        self.scheduler_params = dict(typed.scheduler.params) if typed.scheduler is not None else None
        self.communication_data_type = typed.communication_data_type
        self.comms_config = typed.comms_logger
        self.activation_checkpointing_config = typed.activation_checkpointing
        self.pipeline = typed.pipeline.model_dump()  # DeepSpeed's dict (its 6 keys, plus schedule and zero_hold)

    def __getattr__(self, name: str) -> Any:  # only reached for attributes not set in __init__
        raise AttributeError(
            f"DeepSpeedConfig has no attribute {name!r} in shardspeed; read the typed config instead "
            f"(DeepSpeedConfig(...).config, a ShardSpeedConfig with fields {sorted(ShardSpeedConfig.model_fields)})"
        )

    def print(self, name: str) -> None:
        """Log the config (DeepSpeed prints it at start-up under ``name``)."""
        from shardspeed.utils.logging import logger

        logger.info("%s:\n%s", name, self.config.model_dump_json(indent=2))


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
