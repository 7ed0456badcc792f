"""The engine's training loader: the world-size-independent sampler, or, when
``data_efficiency.data_sampling.curriculum_learning`` is enabled, the difficulty-aware sampler (as DeepSpeed's
``deepspeed_io`` switches to its ``DeepSpeedDataSampler``). Kept out of engine.py, which only calls
:func:`build_training_loader`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.data.difficulty import load_metrics
from shardspeed.data.difficulty_sampler import DifficultySampler
from shardspeed.data.loader import ShardSpeedDataLoader, build_dataloader
from shardspeed.training.events import StepReport

if TYPE_CHECKING:
    from shardspeed.config import ShardSpeedConfig
    from shardspeed.topology import Topology


def build_training_loader(
    training_data: Any,
    config: ShardSpeedConfig,
    topology: Topology,
    collate_fn: Callable[[list[Any]], Any] | None,
    device: torch.device | None,
) -> ShardSpeedDataLoader | None:
    """The loader ``initialize(training_data=...)`` returns, or None without training data."""
    if training_data is None:
        return None
    section = config.data_efficiency.sampling_curriculum
    if section is None:
        return build_dataloader(
            training_data,
            micro_batch_size=config.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            dp_rank=topology.dp_rank,
            dp_world_size=topology.dp_world_size,
            collate_fn=collate_fn,
            seed=config.seed if config.seed is not None else 0,
            device=device,
        )
    return build_difficulty_loader(training_data, config, topology.dp_rank, topology.dp_world_size, collate_fn, device)


def build_difficulty_loader(
    training_data: Any,
    config: ShardSpeedConfig,
    dp_rank: int,
    dp_world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    device: torch.device | None = None,
) -> ShardSpeedDataLoader:
    """A loader over ``training_data`` drawing by difficulty, per ``config.data_efficiency`` (also for scripts that
    build their own loader). Every rank reads the same metric files and raises the same error on a bad one."""
    section = config.data_efficiency.sampling_curriculum
    if section is None:
        raise ValueError("data_efficiency.data_sampling.curriculum_learning is not enabled in this config")
    try:
        num_samples = len(training_data)
    except TypeError:
        raise ValueError(
            f"difficulty sampling needs a map-style dataset with __len__, got {type(training_data).__name__}"
        ) from None
    sampling = config.data_efficiency.data_sampling
    sampler = DifficultySampler(
        load_metrics(section, num_samples),
        num_samples,
        micro_batch_size=config.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=config.data_efficiency.seed,
        num_epochs=sampling.num_epochs,
    )
    device = torch.device(device) if device is not None else None
    return ShardSpeedDataLoader(
        training_data,
        sampler,  # type: ignore[arg-type]  # the same batch-sampler protocol as GlobalIndexSampler
        collate_fn=collate_fn,
        num_workers=sampling.num_workers,
        device=device,
        pin_memory=device is not None and device.type == "cuda",
    )


class DifficultyLog:
    """The progress line of the difficulty sampler: every ``steps_per_print`` steps, on global rank 0, the
    difficulty each metric had for the last global batch (beside ``ProgressLog``'s loss line)."""

    def __init__(self, loader: Any, logger: logging.Logger, steps_per_print: int, global_rank: int) -> None:
        sampler = getattr(loader, "sampler", None)
        self._sampler = sampler if isinstance(sampler, DifficultySampler) and global_rank == 0 else None
        self._logger = logger
        self._every = steps_per_print

    def on_step(self, report: StepReport) -> None:
        if self._sampler is None or report.global_step % self._every:
            return
        difficulties = self._sampler.current_difficulties or {}
        shown = ", ".join(f"{name} {value}" for name, value in sorted(difficulties.items()))
        self._logger.info("step %d: data sampling difficulty %s", report.global_step, shown)
