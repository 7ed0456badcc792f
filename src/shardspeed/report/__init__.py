"""``shardspeed report RUN_DIR``: plots and an HTML page from a finished run's monitor logs.

``write_report(run_dir, out_dir=None)`` finds, anywhere under ``run_dir``, the monitors' CSV files (else their
TensorBoard event files), ``ds_config.json`` and the flops profiler's ``flops_profile.txt``
(``report/scalars.py``); draws ``loss.png``, ``lr.png``, ``throughput.png`` and ``memory.png`` for the plots that
have data (``report/plots.py``); and writes ``index.html`` embedding them with the config and the profiler
summary (``report/page.py``). Tags that are not there are listed on the page, never an exception.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardspeed.report.page import page
from shardspeed.report.plots import missing_tags, plot_specs, render
from shardspeed.report.scalars import RunData, read_run

__all__ = ["RunData", "main", "read_run", "write_report"]


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` into ``out_dir`` (default ``run_dir/report``); returns index.html's path."""
    run = Path(run_dir).resolve()
    out = Path(out_dir).resolve() if out_dir is not None else run / "report"
    data = read_run(run)
    out.mkdir(parents=True, exist_ok=True)
    specs = plot_specs(data.scalars)
    written = []
    for spec in specs:
        stale = out / f"{spec.name}.png"
        if spec.has_data:
            render(spec, out)
            written.append(spec)
        elif stale.exists():  # a plot from an earlier report of this folder no longer has data
            stale.unlink()
    index = out / "index.html"
    index.write_text(page(run, data, written, specs, missing_tags(specs, data.scalars)))
    return index


def main(argv: list[str]) -> int:
    """``shardspeed report RUN_DIR [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="shardspeed report",
        description="Plot a run's monitor logs (CSV or TensorBoard) and write an HTML page with its config and "
        "flops profile. Needs the monitor extra (matplotlib; tensorboard for event files).",
    )
    parser.add_argument("run_dir", help="the run's directory (searched recursively)")
    parser.add_argument("--out", default=None, help="output folder; default RUN_DIR/report")
    args = parser.parse_args(argv)
    try:
        index = write_report(args.run_dir, args.out)
    except (OSError, RuntimeError, ValueError) as error:  # a missing dir, no tensorboard, an unreadable file
        print(f"shardspeed report: error: {error}", file=sys.stderr)
        return 2
    print(f"shardspeed report: wrote {index}")
    return 0
