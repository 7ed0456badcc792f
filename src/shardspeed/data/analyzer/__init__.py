"""``shardspeed data-analyze``: per-sample difficulty metrics written in DeepSpeed's DataAnalyzer layout."""

from __future__ import annotations

from .analyze import AnalysisResult, analyze
from .files import MetricFiles, MetricIndex, load_metric_index, metric_files, write_metric_files
from .metrics import BUILTIN_METRICS

__all__ = [
    "BUILTIN_METRICS",
    "AnalysisResult",
    "MetricFiles",
    "MetricIndex",
    "analyze",
    "load_metric_index",
    "metric_files",
    "write_metric_files",
]
