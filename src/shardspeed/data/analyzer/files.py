"""DeepSpeed's ``DataAnalyzer`` output for a ``single_value_per_sample`` metric, written from one array of values.

Under ``<save_path>/<metric>/`` (all in the indexed format, one document each, DeepSpeed 0.19.8's names):

- ``<metric>_sample_to_metric``: item ``i`` = ``[value of sample i]``; dtype: the smallest integer type of the values.
- ``<metric>_index_to_metric``: one item ``[v]`` per distinct value, ascending.
- ``<metric>_index_to_sample``: row ``r`` = the samples whose value is row ``r``'s, ascending; dtype: the smallest
  integer type holding ``len(dataset) - 1``.
- ``<metric>_index_to_sample_percentile_merged``: consecutive rows merged ``max(1, rows // 100)`` at a time.

The config's ``index_to_sample_path`` / ``index_to_metric_path`` name the prefixes (no ``.bin``/``.idx``).
DeepSpeed gets there through per-worker CSV files and a merge; from the values alone one stable argsort gives the
same files (the tests compare them with DeepSpeed's DataAnalyzer output byte for byte).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardspeed.data.indexed import IndexedDataset, fit_int_dtype, write_flat


@dataclass(frozen=True)
class MetricFiles:
    """Prefixes of the files written for one metric."""

    sample_to_metric: Path
    index_to_sample: Path
    index_to_metric: Path
    index_to_sample_percentile_merged: Path


def metric_files(save_path: str | Path, metric_name: str) -> MetricFiles:
    base = Path(save_path) / metric_name
    return MetricFiles(
        *(
            base / f"{metric_name}_{kind}"
            for kind in ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")
        )
    )


def write_metric_files(values: np.ndarray, save_path: str | Path, metric_name: str) -> MetricFiles:
    """Write DeepSpeed's files for integer per-sample ``values`` (``values[i]`` belongs to sample ``i``)."""
    values = np.asarray(values)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"metric {metric_name!r}: expected one value per sample (a non-empty 1-d array)")
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"metric {metric_name!r}: values must be integers (DeepSpeed's files hold integers only)")
    files = metric_files(save_path, metric_name)
    n = len(values)
    value_dtype = fit_int_dtype(int(values.min()), int(values.max()))
    sample_dtype = fit_int_dtype(0, n - 1)
    write_flat(files.sample_to_metric, values, np.ones(n, dtype=np.int64), value_dtype)
    order = np.argsort(values, kind="stable")  # by value, then by sample index: DeepSpeed's row contents
    unique, counts = np.unique(values, return_counts=True)
    write_flat(files.index_to_sample, order, counts, sample_dtype)
    write_flat(files.index_to_metric, unique, np.ones(len(unique), dtype=np.int64), value_dtype)
    step = max(1, len(unique) // 100)
    merged_sizes = np.add.reduceat(counts, np.arange(0, len(unique), step))
    write_flat(files.index_to_sample_percentile_merged, order, merged_sizes, sample_dtype)
    return files


@dataclass(frozen=True)
class MetricIndex:
    """A metric's ``index_to_sample`` rows (and ``index_to_metric`` values when given), loaded for the sampler."""

    samples: np.ndarray
    """Every sample index, row after row (int64)."""
    row_sizes: np.ndarray
    """Samples per row."""
    row_values: np.ndarray | None
    """The metric value of each row, or None without an ``index_to_metric`` file."""

    def fingerprint(self) -> int:
        """crc32 of the rows and values (the difficulty sampler's state records it; a resume checks it)."""
        crc = zlib.crc32(np.ascontiguousarray(self.samples, dtype=np.int64).tobytes())
        crc = zlib.crc32(np.ascontiguousarray(self.row_sizes, dtype=np.int64).tobytes(), crc)
        if self.row_values is not None:
            crc = zlib.crc32(np.ascontiguousarray(self.row_values, dtype=np.int64).tobytes(), crc)
        return crc


def load_metric_index(index_to_sample_path: str | Path, index_to_metric_path: str | Path | None) -> MetricIndex:
    """Read the analyzer's row files (ours or DeepSpeed's); ``index_to_metric`` rows must hold one value each."""
    rows = IndexedDataset(index_to_sample_path)
    samples = np.asarray(rows.flat, dtype=np.int64)
    sizes = np.asarray(rows.sizes, dtype=np.int64)
    values = None
    if index_to_metric_path is not None:
        metric = IndexedDataset(index_to_metric_path)
        if len(metric) != len(rows) or np.any(metric.sizes != 1):
            raise ValueError(
                f"{index_to_metric_path}: expected one value per row of {index_to_sample_path} ({len(rows)} rows), "
                f"got {len(metric)} items of sizes {sorted(set(metric.sizes.tolist()))[:5]}"
            )
        values = np.asarray(metric.flat, dtype=np.int64)
    return MetricIndex(samples, sizes, values)
