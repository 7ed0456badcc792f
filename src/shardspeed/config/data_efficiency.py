"""``data_efficiency``: DeepSpeed's data-efficiency library, the ``data_sampling`` half (DeepSpeed 0.19.8
``runtime/data_pipeline/config.py`` / ``constants.py``: same keys, same defaults).

``data_sampling.curriculum_learning`` draws each global batch from the samples eligible at the current difficulty of
each metric (``data/difficulty_sampler.py``); the metric files come from ``shardspeed data-analyze`` or DeepSpeed's
DataAnalyzer. ``data_routing.random_ltd`` (enabled) and ``data_sampling.dynamic_batching`` are refused naming the
feature (keys.py); ``data_routing.enabled`` alone does nothing in DeepSpeed and is accepted. As in DeepSpeed, the
sampler is used when ``data_sampling.curriculum_learning.enabled`` is true (DeepSpeed's engine reads only that flag);
the outer ``enabled`` flags are accepted as they are, and a disabled section's metrics are not checked.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .base import ConfigModel, InvalidValue, NonNegativeInt, PositiveInt
from .curriculum import CurriculumScheduleConfig


class CurriculumMetricConfig(CurriculumScheduleConfig):
    """One entry of ``curriculum_metrics``: a metric's index files, how its difficulty reads, and its schedule
    (``min_difficulty`` … ``schedule_config``, shared with the legacy curriculum: config/curriculum.py)."""

    SCHEDULE_REQUIRED: ClassVar[bool] = False
    """Checked by ``DataSamplingCurriculumConfig`` only when curriculum learning is enabled (DeepSpeed reads nothing
    of a disabled section)."""

    index_to_sample_path: str | None = None
    """Prefix of the metric's ``index_to_sample`` files (rows of samples, ascending metric). Required unless
    ``clustering_type`` is ``single_cluster``."""

    index_to_metric_path: str | None = None
    """Prefix of the metric's ``index_to_metric`` files (one value per row). Required for ``difficulty_type: value``
    unless ``single_cluster``."""

    difficulty_type: Literal["value", "percentile"] | None = None
    """``value``: samples whose metric is <= the difficulty are eligible; ``percentile``: the lowest ``difficulty``
    percent of samples by metric (of ``max_difficulty``, usually 100). DeepSpeed: required."""

    clustering_type: Literal["schedule_based", "single_cluster"] = "schedule_based"
    """``single_cluster``: the metric filters nothing (every sample eligible). DeepSpeed: required; shardspeed
    defaults to ``schedule_based``."""

    def check_files(self) -> None:
        """Raise ``InvalidValue`` naming the first missing file key for the metric's type."""
        if self.difficulty_type is None:
            raise InvalidValue("difficulty_type", '"{path}" is required: "value" or "percentile"')
        if self.clustering_type == "schedule_based":
            if self.index_to_sample_path is None:
                raise InvalidValue("index_to_sample_path", 'required with clustering_type "schedule_based"')
            if self.difficulty_type == "value" and self.index_to_metric_path is None:
                raise InvalidValue("index_to_metric_path", 'required with difficulty_type "value"')
        if self.difficulty_type == "percentile" and self.max_difficulty is not None and self.max_difficulty < 1:
            raise InvalidValue("max_difficulty", "a percentile schedule needs max_difficulty >= 1 (usually 100)")


class DataSamplingCurriculumConfig(ConfigModel):
    """``data_sampling.curriculum_learning``: the difficulty-aware sampler."""

    enabled: bool = False
    """Draw batches by difficulty (``data/difficulty_sampler.py``). DeepSpeed default: false."""

    data_cluster_path: str | None = None
    """Where DeepSpeed writes its cluster files. shardspeed recomputes the eligible samples from the metric files in
    memory (pure, identical on every rank) and writes nothing there. DeepSpeed: required when enabled."""

    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """Metric name -> its files, difficulty type and schedule; several metrics: a sample must be eligible under
    each (DeepSpeed's intersection). DeepSpeed: required when enabled."""

    @model_validator(mode="after")
    def _metrics_when_enabled(self) -> DataSamplingCurriculumConfig:
        if not self.enabled:
            return self
        if not self.curriculum_metrics:
            raise InvalidValue("curriculum_metrics", "needs at least one metric when curriculum learning is enabled")
        for name, metric in self.curriculum_metrics.items():
            try:
                metric.check_files()
                metric.check_schedule()
            except InvalidValue as error:
                raise InvalidValue(f"curriculum_metrics.{name}.{error.key}", error.problem) from None
        return self


class DataSamplingConfig(ConfigModel):
    """``data_efficiency.data_sampling``."""

    enabled: bool = False
    """DeepSpeed default: false (its engine decides by ``curriculum_learning.enabled``; so does shardspeed)."""

    num_epochs: PositiveInt = 1000
    """Epochs of the data one iteration of the loader makes (its length: ``num_epochs × len(dataset)`` samples).
    DeepSpeed default: 1000."""

    num_workers: NonNegativeInt = 0
    """DataLoader worker processes reading samples. DeepSpeed default: 0."""

    pin_memory: bool = False
    """Pinned host batches of DeepSpeed's dynamic-batching loader, its only reader in 0.19.8 (dynamic batching is
    refused), so ``true`` is refused; shardspeed's loader pins by itself exactly when the engine's device is CUDA.
    DeepSpeed default: false."""

    curriculum_learning: DataSamplingCurriculumConfig = Field(default_factory=DataSamplingCurriculumConfig)


class DataEfficiencyConfig(ConfigModel):
    """``data_efficiency``: DeepSpeed's data-efficiency library (data sampling; routing is refused)."""

    enabled: bool = False
    """DeepSpeed default: false."""

    seed: NonNegativeInt = 1234
    """Seed of the difficulty sampler's order. DeepSpeed default: 1234."""

    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)

    @property
    def sampling_curriculum(self) -> DataSamplingCurriculumConfig | None:
        """The sampler's section when the difficulty-aware sampler is on (DeepSpeed's rule), else None."""
        section = self.data_sampling.curriculum_learning
        return section if section.enabled else None


__all__ = ["CurriculumMetricConfig", "DataEfficiencyConfig", "DataSamplingConfig", "DataSamplingCurriculumConfig"]
