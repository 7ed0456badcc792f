"""DeepSpeed's accessor-style engine methods, kept in one place so internal code can read the typed config.

Ported scripts call these (``engine.train_micro_batch_size_per_gpu()``, ``engine.fp16_enabled()``, …);
shardspeed's own code never does.
"""

from __future__ import annotations

from typing import Any

import torch


class DeepSpeedCompatMixin:
    config: Any
    topology: Any
    progress: Any

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
