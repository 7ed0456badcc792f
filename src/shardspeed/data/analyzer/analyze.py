"""``analyze``: one metric per sample over a dataset, written as DeepSpeed's DataAnalyzer files.

The dataset is a map-style dataset (``len`` + ``__getitem__``, samples of token ids) or the prefix of an indexed
dataset. Samples are read in chunks of consecutive indices; with ``num_workers > 1`` the chunks go to forked worker
processes (the dataset and metric are inherited by fork, never pickled) and come back in order, so the values do
not depend on the worker count. A built-in metric over an indexed dataset needs no per-sample Python at all: its
sizes and flat token array give every value in a few numpy calls.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from shardspeed.data.indexed import IndexedDataset

from .files import MetricFiles, write_metric_files
from .metrics import (
    BUILTIN_METRICS,
    RARITY_SCALE,
    as_metric_value,
    rarity_of,
    rarity_values,
    seqlen,
    tokens_of,
    user_metric,
)


@dataclass(frozen=True)
class AnalysisResult:
    metric_name: str
    values: np.ndarray
    """One integer per sample."""
    files: MetricFiles | None
    """Where the files went (None when nothing was saved)."""
    seconds: float
    """Time to compute the values (without writing)."""


def analyze(
    dataset: Any,
    metric: str | Callable[[Any], int] = "seqlen",
    *,
    save_path: str | Path | None = None,
    metric_name: str | None = None,
    num_workers: int = 1,
    progress: bool = True,
    chunk_size: int | None = None,
) -> AnalysisResult:
    """Compute ``metric`` for every sample of ``dataset`` and (with ``save_path``) write DeepSpeed's files under
    ``<save_path>/<metric_name>/``. ``metric``: ``"seqlen"``, ``"vocab_rarity"``, ``"module:function"`` or a
    callable ``sample -> int``; ``metric_name`` defaults to the built-in's name or the function's."""
    if isinstance(dataset, (str, Path)):
        dataset = IndexedDataset(dataset)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    try:
        n = len(dataset)
    except TypeError:
        raise ValueError(f"dataset must be a map-style dataset with __len__, got {type(dataset).__name__}") from None
    if n == 0:
        raise ValueError("the dataset is empty: there is nothing to analyze")
    if isinstance(metric, str) and metric not in BUILTIN_METRICS:
        function: Callable[[Any], int] | str = user_metric(metric)
        name = metric_name or metric.rpartition(":")[2]
    else:
        function = metric
        name = metric_name or (metric if isinstance(metric, str) else getattr(metric, "__name__", "metric"))
    start = time.perf_counter()
    if isinstance(dataset, IndexedDataset) and function in BUILTIN_METRICS:
        values = _indexed_builtin(dataset, str(function))
    else:
        values = _by_sample(dataset, function, name, n, num_workers, progress, chunk_size)
    seconds = time.perf_counter() - start
    files = write_metric_files(values, save_path, name) if save_path is not None else None
    return AnalysisResult(name, values, files, seconds)


CHUNK_TOKENS = 1 << 24
"""Tokens read at once from an indexed dataset's memmap by the built-in metrics (bounded memory at any corpus size)."""


def _item_chunks(sizes: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive item ranges of about ``chunk_tokens`` tokens each (at least one item)."""
    ends = np.cumsum(sizes)
    bounds, first = [], 0
    while first < len(sizes):
        start = int(ends[first] - sizes[first])
        last = max(first + 1, int(np.searchsorted(ends, start + chunk_tokens, side="right")))
        bounds.append((first, min(last, len(sizes))))
        first = bounds[-1][1]
    return bounds


def _indexed_builtin(dataset: IndexedDataset, metric: str, chunk_tokens: int = CHUNK_TOKENS) -> np.ndarray:
    """The built-in metrics straight off the memmap, chunk by chunk: a token histogram, then per-item sums."""
    sizes = np.asarray(dataset.sizes, dtype=np.int64)
    if metric == "seqlen":
        return sizes.copy()
    flat, ends = dataset.flat, np.cumsum(sizes)
    chunks = _item_chunks(sizes, chunk_tokens)
    counts = np.zeros(0, dtype=np.int64)
    for first, last in chunks:
        tokens = np.asarray(flat[ends[first] - sizes[first] : ends[last - 1]], dtype=np.int64)
        mine = np.bincount(tokens)
        if len(mine) > len(counts):
            counts = np.concatenate((counts, np.zeros(len(mine) - len(counts), dtype=np.int64)))
        counts[: len(mine)] += mine
    neg_log = rarity_values(counts)
    sums = np.zeros(len(sizes))
    for first, last in chunks:
        base = int(ends[first] - sizes[first])
        tokens = np.asarray(flat[base : ends[last - 1]], dtype=np.int64)
        local = sizes[first:last]
        nonempty = local > 0
        if tokens.size:
            starts = np.concatenate(([0], np.cumsum(local)[:-1]))
            sums[first:last][nonempty] = np.add.reduceat(neg_log[tokens], starts[nonempty])
    nonempty = sizes > 0
    means = np.divide(sums, sizes, out=np.zeros(len(sizes)), where=nonempty)
    return np.rint(RARITY_SCALE * means).astype(np.int64)


# [Note: analyzer workers] The worker's dataset, metric and rarity table are handed over by fork (Pool initargs
# are not pickled under the fork start method), so any dataset works, picklable or not. They live in this one
# module-level slot of the *worker* process only; the parent never reads it.
_WORKER: dict[str, Any] = {}


def _init_worker(dataset: Any, function: Any, name: str, neg_log: np.ndarray | None) -> None:
    _WORKER.update(dataset=dataset, function=function, name=name, neg_log=neg_log)


def _chunk_values(bounds: tuple[int, int]) -> np.ndarray:
    dataset, function, name = _WORKER["dataset"], _WORKER["function"], _WORKER["name"]
    out = np.empty(bounds[1] - bounds[0], dtype=np.int64)
    for k, i in enumerate(range(*bounds)):
        sample = dataset[i]
        if function == "seqlen":
            out[k] = seqlen(sample)
        elif function == "vocab_rarity":
            out[k] = rarity_of(tokens_of(sample).astype(np.int64), _WORKER["neg_log"])
        else:
            out[k] = as_metric_value(function(sample), i, name)
    return out


def _chunk_counts(bounds: tuple[int, int]) -> np.ndarray:
    dataset = _WORKER["dataset"]
    tokens = [tokens_of(dataset[i]).astype(np.int64) for i in range(*bounds)]
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    if flat.size and flat.min() < 0:
        raise ValueError(f"vocab_rarity: negative token id {flat.min()} in samples {bounds[0]}..{bounds[1] - 1}")
    return np.bincount(flat)


def _map_chunks(
    work: Callable[[tuple[int, int]], np.ndarray],
    initargs: tuple[Any, ...],
    n: int,
    num_workers: int,
    chunk_size: int,
    label: str,
    progress: bool,
) -> Iterator[np.ndarray]:
    chunks = [(s, min(n, s + chunk_size)) for s in range(0, n, chunk_size)]
    bar = tqdm(total=n, desc=label, unit="sample", disable=not progress, mininterval=0.5)
    try:
        if num_workers == 1:
            _init_worker(*initargs)
            results: Iterator[np.ndarray] = map(work, chunks)
            pool = None
        else:
            pool = multiprocessing.get_context("fork").Pool(num_workers, _init_worker, initargs)
            results = pool.imap(work, chunks)
        for (s, e), result in zip(chunks, results, strict=True):
            bar.update(e - s)
            yield result
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
    finally:
        bar.close()
        _WORKER.clear()
        if pool is not None:
            pool.terminate()


def _by_sample(
    dataset: Any, function: Any, name: str, n: int, num_workers: int, progress: bool, chunk_size: int | None
) -> np.ndarray:
    size = chunk_size or max(1, min(20_000, -(-n // (8 * num_workers))))
    neg_log = None
    if function == "vocab_rarity":
        counts = np.zeros(0, dtype=np.int64)
        for part in _map_chunks(
            _chunk_counts, (dataset, function, name, None), n, num_workers, size, "counting tokens", progress
        ):
            if len(part) > len(counts):
                part, counts = counts, part
            counts[: len(part)] += part
        neg_log = rarity_values(counts)
    parts = _map_chunks(_chunk_values, (dataset, function, name, neg_log), n, num_workers, size, name, progress)
    return np.concatenate(list(parts))
