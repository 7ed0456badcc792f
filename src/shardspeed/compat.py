"""DeepSpeed's accessor-style engine methods, kept in one place so internal code can read the typed config.

Ported scripts call these (``engine.train_micro_batch_size_per_gpu()``, ``engine.fp16_enabled()``, …);
shardspeed's own code never does.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class DeepSpeedCompatMixin:
    config: Any
    topology: Any
    progress: Any
    optimizer: Any
    loss_scaler: Any
    _driver: Any

    # DeepSpeed's counters, as engine attributes (the loop's ``Progress`` owns them; checkpoints restore that)
    @property
    def global_steps(self) -> int:
        return self.progress.global_steps

    @property
    def global_samples(self) -> int:
        return self.progress.global_samples

    @property
    def micro_steps(self) -> int:
        return self.progress.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.progress.skipped_steps

    def curriculum_enabled_legacy(self) -> bool:
        return self.config.curriculum_learning.enabled

    def curriculum_params_legacy(self) -> dict[str, Any]:
        """The ``curriculum_learning`` section as DeepSpeed's dict (``enabled`` and unset keys left out)."""
        return self.config.curriculum_learning.model_dump(exclude={"enabled"}, exclude_none=True)

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return self.config.torch_autocast.dtype

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    @property
    def dp_world_size(self) -> int:
        return self.topology.dp_world_size

    @property
    def global_rank(self) -> int:
        return self.topology.global_rank

    @property
    def world_size(self) -> int:
        return self.topology.shape.world_size

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor) world size; 1 without tensor parallelism."""
        return self.topology.shape.tensor

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (DeepSpeed reads ``LOCAL_RANK`` too; a lone process is 0)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage above 0 is on (DeepSpeed's ``zero_enabled``)."""
        return self.config.zero_optimization.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_optimization.stage >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.gather_16bit_weights_on_model_save

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def loss_scale(self) -> float:
        """The configured fp16 ``loss_scale`` (0: dynamic), as DeepSpeed's accessor; see ``get_loss_scale``."""
        return self.config.fp16.loss_scale

    def get_loss_scale(self) -> float:
        """The current loss scale: fp16's (dynamic or static), 1.0 without loss scaling."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's optimizers' ``cur_scale``: the current loss scale."""
        return self.get_loss_scale()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` changed the parameters: False on a non-boundary micro-step and after an fp16
        overflow skipped the step (as DeepSpeed)."""
        return bool(self.__dict__.get("_step_applied", False))

    def get_mom(self) -> list[Any]:
        """Per parameter group: Adam-style ``betas``, else SGD-style ``momentum``, else 0.0 (DeepSpeed's rule by
        optimizer name, read from the groups' keys)."""
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum", 0.0)) for g in self.optimizer.param_groups]

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing gradient accumulation (the micro batch stays), as DeepSpeed.
        Call it between optimizer steps; the next accumulation window starts fresh."""
        micro, dp = self.config.train_micro_batch_size_per_gpu, self.topology.dp_world_size
        if train_batch_size <= 0 or train_batch_size % (micro * dp) != 0:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): must be a positive multiple of micro batch {micro} × "
                f"data-parallel size {dp}"
            )
        driver = self._driver
        if driver.progress.micro_steps % driver.gradient_accumulation_steps != 0:
            raise RuntimeError(
                "set_train_batch_size() in the middle of a gradient-accumulation window "
                f"({driver.progress.micro_steps % driver.gradient_accumulation_steps} of "
                f"{driver.gradient_accumulation_steps} micro-steps done); call it right after step() at a boundary"
            )
        gas = train_batch_size // (micro * dp)
        self.config = self.config.model_copy(
            update={"train_batch_size": train_batch_size, "gradient_accumulation_steps": gas}
        )
        driver.gradient_accumulation_steps, driver.train_batch_size = gas, train_batch_size
        driver.progress.micro_steps = driver.progress.global_steps * gas  # boundaries counted in the new GAS

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.safetensors") -> bool:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)  # type: ignore[attr-defined]

    # DeepSpeed's data-efficiency accessors (config/data_efficiency.py; the sampler: data/difficulty_sampler.py).
    def data_efficiency_enabled(self) -> bool:
        return self.config.data_efficiency.enabled

    def data_sampling_enabled(self) -> bool:
        return self.config.data_efficiency.data_sampling.enabled

    def curriculum_learning_enabled(self) -> bool:
        """Whether the difficulty-aware sampler is on (``data_sampling.curriculum_learning.enabled``, DeepSpeed's)."""
        return self.config.data_efficiency.data_sampling.curriculum_learning.enabled

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Any]) -> None:
        """Metric name -> ``fn(global batch) -> difficulty`` for metrics with ``schedule_type: custom`` (DeepSpeed's
        API; without a training loader drawing by difficulty it does nothing, as DeepSpeed)."""
        loader = self.training_dataloader  # type: ignore[attr-defined]
        if loader is not None and self.curriculum_learning_enabled():
            loader.sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """DeepSpeed's hook: the training loader calls ``post_process_func(batch, sampler_state)`` on each batch it
        delivers; with difficulty sampling ``sampler_state["current_difficulties"]`` are that batch's (e.g. a
        ``single_cluster`` ``seqlen_truncate`` metric the hook cuts to). Without a training loader: nothing."""
        loader = self.training_dataloader  # type: ignore[attr-defined]
        if loader is not None:
            loader.post_process_func = post_process_func
