"""What a tune leaves in ``results_dir`` (DeepSpeed's names where it has them): ``ds_config_optimal.json``,
``cmd_optimal.txt``, ``summary.txt`` (the ranked table), plus ``trials.jsonl`` / ``trials.csv`` (one row per point:
config, predicted and measured memory, metric, status — pruned and invalid points too) and
``metric_vs_micro_batch.png``; and the progress bar over trials on stderr."""

from __future__ import annotations

import csv
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = ["ProgressBar", "TrialRow", "plot_metric_vs_micro_batch", "rank_rows", "write_results"]

OPTIMAL_CONFIG = "ds_config_optimal.json"
OPTIMAL_CMD = "cmd_optimal.txt"
SUMMARY = "summary.txt"
TRIALS_JSONL = "trials.jsonl"
TRIALS_CSV = "trials.csv"
PLOT = "metric_vs_micro_batch.png"


@dataclass
class TrialRow:
    """One point of the space and what became of it."""

    name: str
    point: dict[str, Any]
    status: str
    """ok / failed / timeout / pruned (memory) / invalid (the strict config or batch rules) / skipped (thinned)."""
    metric: float | None = None
    score: float | None = None
    wall_s: float | None = None
    predicted_bytes: float | None = None
    """What the trial should measure, predicted before it ran (memory.py ``measured_equivalent``)."""
    predicted_device_bytes: float | None = None
    measured_bytes: float | None = None
    fitted_bytes: float | None = None
    """The final correction's prediction, for comparison with ``measured_bytes``."""
    error: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    predicted_accounted_bytes: float | None = None
    """The model's own part, predicted: model states + activations (no fitted offset, no runtime)."""
    accounted_bytes: float | None = None
    """That part as the trial measured it on its largest rank (probe.py [Note: accounted memory])."""

    def prediction_error(self, fitted: bool = False) -> float | None:
        predicted = self.fitted_bytes if fitted else self.predicted_bytes
        if predicted is None or not self.measured_bytes:
            return None
        return (predicted - self.measured_bytes) / self.measured_bytes

    def accounted_error(self) -> float | None:
        """(predicted - measured) / measured of the model's own part: the check that means something on CPU,
        where the peak RSS is mostly the runtime's."""
        if self.predicted_accounted_bytes is None or not self.accounted_bytes:
            return None
        return (self.predicted_accounted_bytes - self.accounted_bytes) / self.accounted_bytes


def rank_rows(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Trials that ran, best score first (pure)."""
    return sorted((r for r in rows if r.status == "ok" and r.score is not None), key=lambda r: -(r.score or 0.0))


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def summary_text(rows: Sequence[TrialRow], metric_name: str, notes: Sequence[str]) -> str:
    ranked = rank_rows(rows)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    lines = [f"autotuning summary (metric: {metric_name})", ""]
    header = (
        f"{'rank':>4}  {'trial':<34} {metric_name:>12} {'pred MB':>9} {'meas MB':>9} {'err':>7} {'fit err':>8} "
        f"{'model MB':>9} {'model err':>9}"
    )
    lines += [header, "-" * len(header)]
    for i, row in enumerate(ranked, 1):
        lines.append(
            f"{i:>4}  {row.name:<34} {row.metric or 0:>12.4g} {_mb(row.predicted_bytes):>9} "
            f"{_mb(row.measured_bytes):>9} {_pct(row.prediction_error()):>7} {_pct(row.prediction_error(True)):>8} "
            f"{_mb(row.accounted_bytes):>9} {_pct(row.accounted_error()):>9}"
        )
    others = [r for r in rows if r.status in ("failed", "timeout")]
    if others:
        lines += ["", "trials that did not finish:"]
        lines += [f"  {r.name}: {r.status}: {r.error}" for r in others]
    lines += ["", "points: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
    lines += list(notes)
    if ranked:
        lines.append(f"best: {ranked[0].name} ({metric_name} {ranked[0].metric:.4g})")
    return "\n".join(lines) + "\n"


def write_results(
    results_dir: Path,
    rows: Sequence[TrialRow],
    metric_name: str,
    *,
    command: Sequence[str],
    notes: Sequence[str] = (),
    plot: bool = True,
) -> TrialRow | None:
    """Write every file; returns the best row (None when no trial ran: then no optimal config is written)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    with (results_dir / TRIALS_JSONL).open("w") as out:
        for row in rows:
            out.write(json.dumps(row.__dict__) + "\n")
    columns = [k for k in TrialRow.__dataclass_fields__ if k not in ("point", "config")]
    point_keys = sorted({k for row in rows for k in row.point})
    with (results_dir / TRIALS_CSV).open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(columns + point_keys)
        for row in rows:
            writer.writerow([getattr(row, k) for k in columns] + [row.point.get(k) for k in point_keys])
    (results_dir / SUMMARY).write_text(summary_text(rows, metric_name, notes))
    ranked = rank_rows(rows)
    if not ranked:
        return None
    best = ranked[0]
    (results_dir / OPTIMAL_CONFIG).write_text(json.dumps(best.config, indent=2) + "\n")
    (results_dir / OPTIMAL_CMD).write_text(shlex.join(command) + "\n")
    if plot:  # matplotlib's import alone takes seconds: tests without processes skip it
        plot_metric_vs_micro_batch(rows, metric_name, results_dir / PLOT)
    return best


def plot_metric_vs_micro_batch(rows: Sequence[TrialRow], metric_name: str, path: Path) -> bool:
    """Metric against micro-batch, one line per ZeRO stage (best over the other dimensions). False without
    matplotlib (an optional package)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    best: dict[int, dict[int, float]] = {}
    for row in rank_rows(rows):
        stage, mb = int(row.point["stage"]), int(row.point["micro_batch"])
        best.setdefault(stage, {}).setdefault(mb, row.metric or 0.0)
    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for stage in sorted(best):
        xs = sorted(best[stage])
        axes.plot(xs, [best[stage][x] for x in xs], marker="o", label=f"ZeRO stage {stage}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("micro-batch size per rank")
    axes.set_ylabel(metric_name)
    axes.set_title("autotuning: best trial per stage and micro-batch")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


class ProgressBar:
    """One line per finished trial on stderr: ``[autotuning] ███░░░ 3/8 z1_mb8_gas1: ok 165 (best z1_mb8_gas1)``."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 20) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width

    def update(self, row: TrialRow, best: str | None) -> None:
        self.done += 1
        filled = min(self.width, round(self.width * self.done / self.total))
        bar = "█" * filled + "░" * (self.width - filled)
        figure = f"{row.metric:.4g}" if row.metric is not None else (row.error or "")[:60]
        print(
            f"[autotuning] {bar} {self.done}/{self.total} {row.name}: {row.status} {figure} (best: {best or '-'})",
            file=self.stream,
            flush=True,
        )
