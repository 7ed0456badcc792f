"""Which samples are eligible at a difficulty: pure functions of a metric's index files (DeepSpeed's rules).

A metric's ``index_to_sample`` rows list samples by ascending metric value (``index_to_metric``: one value per row).

- ``value``: a sample is eligible when its metric is <= the difficulty (DeepSpeed's
  ``get_sample_based_on_metric_value``, from -inf).
- ``percentile``: the first ``(N // max_difficulty) × difficulty`` samples in row order, all ``N`` at
  ``max_difficulty`` (DeepSpeed's ``get_sample_based_on_metric_percentile``, from 0).
- ``single_cluster``: the metric filters nothing.

Several metrics: the intersection (DeepSpeed intersects the metrics' clusters). DeepSpeed builds the eligible set
incrementally as clusters of newly eligible samples; the union of its clusters is this set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from shardspeed.data.analyzer.files import MetricIndex, load_metric_index
from shardspeed.data.curriculum import CurriculumSchedule, schedule_from_config, sticky_difficulty


@dataclass(frozen=True)
class MetricCurriculum:
    """One metric of the sampler: its schedule and (unless ``single_cluster``) its rows."""

    name: str
    schedule: CurriculumSchedule
    difficulty_type: str
    """``value`` or ``percentile``."""
    index: MetricIndex | None
    """None: ``single_cluster`` (every sample eligible)."""
    source: str = ""
    """The ``index_to_sample_path`` the rows were read from (named in errors)."""

    def eligible(self, difficulty: int, num_samples: int) -> np.ndarray:
        """The eligible sample indices, sorted."""
        if self.index is None:
            return np.arange(num_samples, dtype=np.int64)
        samples = self.index.samples
        if self.difficulty_type == "value":
            assert self.index.row_values is not None  # checked when loaded
            keep = np.repeat(self.index.row_values <= difficulty, self.index.row_sizes)
            return np.sort(samples[keep])
        top = self.schedule.max_difficulty
        count = len(samples) if difficulty >= top else (len(samples) // top) * max(0, difficulty)
        return np.sort(samples[:count])


def eligible_mask(
    metrics: tuple[MetricCurriculum, ...], difficulties: Mapping[str, int], num_samples: int
) -> np.ndarray:
    """Per sample: eligible under every metric at ``difficulties`` (the set of :func:`eligible_samples`, no sort)."""
    mask = np.ones(num_samples, dtype=bool)
    for metric in metrics:
        if metric.index is None:
            continue
        mine = np.zeros(num_samples, dtype=bool)
        samples, difficulty = metric.index.samples, difficulties[metric.name]
        if metric.difficulty_type == "value":
            assert metric.index.row_values is not None  # checked when loaded
            mine[samples[np.repeat(metric.index.row_values <= difficulty, metric.index.row_sizes)]] = True
        else:
            top = metric.schedule.max_difficulty
            mine[samples[: len(samples) if difficulty >= top else (len(samples) // top) * max(0, difficulty)]] = True
        mask &= mine
    return mask


def eligible_samples(
    metrics: tuple[MetricCurriculum, ...], difficulties: Mapping[str, int], num_samples: int
) -> np.ndarray:
    """Samples eligible under every metric at ``difficulties`` (sorted)."""
    result: np.ndarray | None = None
    for metric in metrics:
        mine = metric.eligible(difficulties.get(metric.name, 0), num_samples)
        result = mine if result is None else np.intersect1d(result, mine, assume_unique=True)
    assert result is not None
    return result


def next_difficulties(
    metrics: tuple[MetricCurriculum, ...],
    current: Mapping[str, int] | None,
    curriculum_step: int,
    custom: Mapping[str, Callable[[int], int]],
) -> dict[str, int]:
    """DeepSpeed's ``update_difficulty`` for each metric at ``curriculum_step`` (1 for the first global batch):
    from ``min_difficulty``, and once a metric reached its ``max_difficulty`` it stays there."""
    out = {}
    for m in metrics:
        now = m.schedule.min_difficulty if current is None else current[m.name]
        out[m.name] = sticky_difficulty(m.schedule, now, curriculum_step, custom.get(m.name))
    return out


def load_metrics(section: object, num_samples: int) -> tuple[MetricCurriculum, ...]:
    """The sampler's metrics from a typed ``DataSamplingCurriculumConfig`` (config/data_efficiency.py), their files
    checked against the dataset: each row file must list every sample index in [0, num_samples) exactly once."""
    metrics = []
    for name, cfg in section.curriculum_metrics.items():  # type: ignore[attr-defined]
        index = None
        if cfg.clustering_type != "single_cluster":
            metric_path = cfg.index_to_metric_path if cfg.difficulty_type == "value" else None
            try:
                index = load_metric_index(cfg.index_to_sample_path, metric_path)
            except (OSError, ValueError) as error:
                raise ValueError(f"curriculum metric {name!r}: {error}") from error
            _check_covers(name, cfg.index_to_sample_path, index.samples, num_samples)
        source = str(cfg.index_to_sample_path) if index is not None else ""
        metrics.append(MetricCurriculum(name, schedule_from_config(cfg), cfg.difficulty_type, index, source))
    return tuple(metrics)


def _check_covers(name: str, path: str, samples: np.ndarray, num_samples: int) -> None:
    problem = None
    if len(samples) != num_samples:
        problem = f"lists {len(samples)} samples but the dataset has {num_samples}"
    elif num_samples and (samples.min() < 0 or samples.max() >= num_samples):
        problem = f"holds sample index {int(samples.max())} outside the dataset's [0, {num_samples})"
    elif np.any(np.bincount(samples, minlength=num_samples) != 1):
        problem = "lists some samples more than once"
    if problem is not None:
        raise ValueError(
            f"curriculum metric {name!r}: {path} {problem}; analyze this dataset (shardspeed data-analyze) and point "
            "index_to_sample_path at the result"
        )
