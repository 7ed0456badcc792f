"""``autotuning``: DeepSpeed's autotuner section (DeepSpeed 0.19.8 ``autotuning/config.py`` and
``autotuning/constants.py``: same keys, same defaults), plus shardspeed's memory budgets and progress file.

Two readers: the autotuner (``shardspeed --autotuning tune|run``, shardspeed/autotuning/) reads the tuning keys from
the user's config; the engine reads ``enabled`` / the profile window / ``metric_path`` / ``progress_path`` in each
trial's config, writes the metric JSON after ``end_profile_step`` and exits (autotuning/probe.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from .base import ConfigModel, InvalidValue, NonNegativeInt, PositiveFloat, PositiveInt


class AutotuningConfig(ConfigModel):
    """``autotuning``: find the fastest ZeRO stage / micro-batch / offload / bucket configuration by short trials."""

    enabled: bool = False
    """In a trial's config: the engine measures steps ``start_profile_step``..``end_profile_step``, writes the metric
    JSON and exits. DeepSpeed default: false."""

    fast: bool = True
    """Tune fewer points (no bucket sizes / overlap, only the stages' micro-batch sweep). DeepSpeed default: true."""

    results_dir: str = "autotuning_results"
    """Where ds_config_optimal.json, cmd_optimal.txt, summary.txt go. DeepSpeed default: autotuning_results."""

    exps_dir: str = "autotuning_exps"
    """One directory per trial (config, log, metric JSON). DeepSpeed default: autotuning_exps."""

    overwrite: bool = True
    """Re-run trials whose results exist. DeepSpeed default: true."""

    start_profile_step: PositiveInt = 3
    """First measured optimizer step (earlier steps warm up). DeepSpeed default: 3."""

    end_profile_step: PositiveInt = 5
    """Last measured step; the trial exits after it. DeepSpeed default: 5."""

    metric_path: str | None = None
    """Where the engine writes the metric JSON. DeepSpeed default: none (``./autotuning_metric.json``)."""

    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """What the tuner maximises (latency: minimises). DeepSpeed default: throughput."""

    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Order in which points are tried. DeepSpeed default: gridsearch."""

    tuner_early_stopping: PositiveInt = 5
    """Stop after this many trials without a better metric. DeepSpeed default: 5."""

    tuner_num_trials: PositiveInt = 50
    """At most this many trials. DeepSpeed default: 50."""

    arg_mappings: dict[str, str] | None = None
    """Config key -> script argument carrying it (e.g. ``{"train_micro_batch_size_per_gpu": "--batch"}``): each
    trial's script gets the value on its command line too. DeepSpeed default: none."""

    max_train_batch_size: PositiveInt | None = None
    """Largest global batch a trial may use. DeepSpeed default: none."""

    min_train_batch_size: PositiveInt = 1
    """Smallest global batch a trial may use. DeepSpeed default: 1."""

    max_train_micro_batch_size_per_gpu: PositiveInt = 1024
    """Largest micro-batch tried. DeepSpeed default: 1024."""

    min_train_micro_batch_size_per_gpu: PositiveInt = 1
    """Smallest micro-batch tried. DeepSpeed default: 1."""

    num_tuning_micro_batch_sizes: PositiveInt = 3
    """Micro-batch sizes tried per stage (spread between the bounds). DeepSpeed default: 3."""

    mp_size: PositiveInt = 1
    """Model-parallel degree (divides the data-parallel world). DeepSpeed default: 1."""

    model_info: dict[str, Any] | None = None
    """``num_params`` / ``hidden_size`` / ``num_layers`` / ``profile``; shardspeed measures the model itself (one
    profiled micro-batch) and uses ``num_params`` only when given. DeepSpeed default: none."""

    model_info_path: str | None = None
    """Where a model-info profile is written. DeepSpeed default: none."""

    device_memory_gb: PositiveFloat | None = None
    """The device-memory budget per rank (GB, 1e9 B). On CPU-only machines a simulated budget; on CUDA default: the
    device's memory. Not a DeepSpeed key."""

    host_memory_gb: PositiveFloat | None = None
    """The host-memory budget per node (GB). Default: the machine's memory. Not a DeepSpeed key."""

    progress_path: str | None = None
    """Where the engine appends one JSON line per optimizer step in a trial (step, loss, samples/s). Default:
    ``progress.jsonl`` beside ``metric_path``. Not a DeepSpeed key."""

    trial_timeout_s: NonNegativeInt = 600
    """A trial running longer is stopped and recorded as "timeout" (0: no limit). Not a DeepSpeed key."""

    @model_validator(mode="after")
    def _window(self) -> AutotuningConfig:
        if self.end_profile_step <= self.start_profile_step:
            raise InvalidValue(
                "end_profile_step",
                f"must be greater than start_profile_step ({self.start_profile_step}); got {self.end_profile_step}",
            )
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise InvalidValue(
                "min_train_micro_batch_size_per_gpu", "is greater than max_train_micro_batch_size_per_gpu"
            )
        return self
