"""``shardspeed data-analyze``: compute a per-sample metric and write DeepSpeed's index files.

    shardspeed data-analyze --data PREFIX --metric seqlen --save-path OUT [--num-workers 4]
    shardspeed data-analyze --dataset my_pkg.data:build --metric my_pkg.metrics:difficulty --save-path OUT

``--data`` is an indexed dataset prefix (``PREFIX.bin`` / ``PREFIX.idx``); ``--dataset module:function`` calls a
function of no arguments returning a map-style dataset. The files land in ``OUT/<metric name>/``; the last lines
printed are the ``index_to_sample_path`` / ``index_to_metric_path`` to put in the config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardspeed.data.indexed import IndexedDataset

from .analyze import analyze
from .metrics import BUILTIN_METRICS, user_metric


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardspeed data-analyze",
        description="Compute one metric per sample and write DeepSpeed's DataAnalyzer files (indexed format).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="indexed dataset prefix (PREFIX.bin and PREFIX.idx)")
    source.add_argument("--dataset", help="'module:function' returning a map-style dataset of token sequences")
    p.add_argument(
        "--metric", default="seqlen", help=f"{' | '.join(BUILTIN_METRICS)} | 'module:function' (sample -> int)"
    )
    p.add_argument("--metric-name", help="name of the output folder and files (default: the metric's)")
    p.add_argument("--save-path", required=True, help="output root: files go to SAVE_PATH/<metric name>/")
    p.add_argument("--num-workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        dataset = IndexedDataset(args.data) if args.data else user_metric(args.dataset)()
        result = analyze(
            dataset,
            args.metric,
            save_path=args.save_path,
            metric_name=args.metric_name,
            num_workers=args.num_workers,
            progress=not args.no_progress,
        )
    except (ValueError, OSError, ImportError) as error:
        print(f"shardspeed data-analyze: error: {error}", file=sys.stderr)
        return 2
    values, files = result.values, result.files
    assert files is not None
    rate = len(values) / result.seconds if result.seconds > 0 else float("inf")
    print(
        f"{result.metric_name}: {len(values)} samples in {result.seconds:.2f} s ({rate:,.0f} samples/s), "
        f"values {int(values.min())}..{int(values.max())}"
    )
    print(f"index_to_sample_path: {files.index_to_sample}")
    print(f"index_to_metric_path: {files.index_to_metric}")
    return 0
