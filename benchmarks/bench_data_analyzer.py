"""Throughput of ``shardspeed data-analyze`` (issue 20) on a synthetic 1M-sample token dataset.

    python benchmarks/bench_data_analyzer.py                       # 1M samples, 3 repeats
    python benchmarks/bench_data_analyzer.py --samples 200000 --repeats 5 --workers 1 2 4

The dataset: ``--samples`` sequences of 8..128 Zipf-distributed token ids (vocabulary 50,257), written once as an
indexed dataset (uint16) in a temporary directory. Rows, each timed ``--repeats`` times (median samples/s and the
interquartile range):

- ``indexed/<metric>``: the dataset given as its indexed prefix: built-in metrics take the vectorised path
  (sizes, one bincount, one reduceat);
- ``map/<metric>/w<k>``: the same samples behind a torch-style map dataset (``ds[i]`` -> a LongTensor), one Python
  call per sample, over ``k`` forked worker processes;
- ``write``: writing DeepSpeed's four files for the ``seqlen`` values (sample_to_metric, index_to_sample,
  index_to_metric, percentile_merged).

Timings on a shared machine are indicative; the table prints the load average next to them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import interquartile_range, median

from shardspeed.data.analyzer import analyze, write_metric_files
from shardspeed.data.indexed import IndexedDataset, write_flat

VOCAB = 50257


class TokenDataset(torch.utils.data.Dataset):
    """A torch-style map dataset of token tensors (read from the indexed files, one copy per sample)."""

    def __init__(self, indexed: IndexedDataset) -> None:
        self.indexed = indexed

    def __len__(self) -> int:
        return len(self.indexed)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.indexed[i].astype(np.int64))


def make_dataset(prefix: Path, samples: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(8, 129, size=samples)
    tokens = (rng.zipf(1.3, size=int(sizes.sum())) - 1) % VOCAB
    write_flat(prefix, tokens.astype(np.uint16), sizes, np.uint16)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--metrics", nargs="+", default=["seqlen", "vocab_rarity"])
    p.add_argument("--map-samples", type=int, default=None, help="map rows: only the first N samples (default all)")
    args = p.parse_args(argv)
    rows: list[tuple[str, list[float], int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "tokens"
        start = time.perf_counter()
        make_dataset(prefix, args.samples)
        indexed = IndexedDataset(prefix)
        tokens = int(indexed.sizes.sum())
        print(f"dataset: {args.samples} samples, {tokens} tokens, built in {time.perf_counter() - start:.1f} s")
        values = None
        for metric in args.metrics:
            times = timed(lambda m=metric: analyze(str(prefix), m, progress=False), args.repeats)
            rows.append((f"indexed/{metric}", times, args.samples))
            values = analyze(str(prefix), "seqlen", progress=False).values if values is None else values
        map_n = min(args.map_samples or args.samples, args.samples)
        mapped = torch.utils.data.Subset(TokenDataset(indexed), range(map_n))
        for metric in args.metrics:
            for k in args.workers:
                times = timed(lambda m=metric, k=k: analyze(mapped, m, num_workers=k, progress=False), args.repeats)
                rows.append((f"map/{metric}/w{k}", times, len(mapped)))
        assert values is not None
        write = timed(lambda: write_metric_files(values, Path(tmp) / "out", "seqlen"), args.repeats)
        rows.append(("write", write, args.samples))
    load = os.getloadavg()[0]
    print(f"\n{'row':<26} {'samples':>9} {'samples/s (median)':>20} {'IQR':>26}")
    for name, times, n in rows:
        rates = [n / t for t in times]
        lo, hi = interquartile_range(rates)
        print(f"{name:<26} {n:>9} {median(rates):>20,.0f} {f'{lo:,.0f} .. {hi:,.0f}':>26}")
    print(f"(load average {load:.1f} on {os.cpu_count()} CPUs, {args.repeats} repeats per row)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
