"""The report's four plots: which tags each draws (pure ``plot_specs``) and drawing them (``render``, matplotlib).

``plot_specs`` decides everything from the scalars — panels, series, labels, units — so tests check what a plot
holds without reading pixels; ``figure`` turns a spec into a matplotlib ``Figure`` (the object-oriented API on the
Agg canvas: no pyplot, no global backend state), and ``render`` writes it as a PNG. matplotlib is imported only
here, when a report is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardspeed.report.scalars import Series

LOSS, LR = "Train/Samples/train_loss", "Train/Samples/lr"
SAMPLES_PER_S, TOKENS_PER_S = "Train/Samples/samples_per_second", "Train/Samples/tokens_per_second"
MFU = "Train/Samples/mfu"  # a fraction; drawn in percent beside the throughput when the profiler gave FLOPs
MEMORY_KINDS = ("model_state_bytes", "predicted_model_state_bytes", "host_peak_bytes", "device_peak_bytes")
"""The memory plot's lines per rank: the measured model states (``engine.memory_breakdown()``) against the memory
model's prediction, the like-for-like pair; the process's host / device peaks are context (dashed), since they
also hold activations, buffers and the runtime."""
MEMORY_STYLES = {
    "model_state_bytes": "-",
    "predicted_model_state_bytes": ":",
    "host_peak_bytes": "--",
    "device_peak_bytes": "-.",
}
_MEMORY_TAG = re.compile(r"Memory/rank(\d+)/(\w+)")
_LR_GROUP = re.compile(r"Train/Samples/lr_group(\d+)")
MIB = 2.0**20


@dataclass(frozen=True)
class Line:
    label: str
    xs: list[int]
    ys: list[float]
    style: str = "-"
    color: str | None = None  # matplotlib's cycle when None; the memory plot keeps one colour per rank


@dataclass
class Panel:
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    log_y: bool = False


@dataclass
class PlotSpec:
    """One PNG: its file name, title and panels (side by side). ``wanted``: the tags it draws from."""

    name: str
    title: str
    panels: list[Panel]
    wanted: list[str]

    @property
    def has_data(self) -> bool:
        return any(line.xs for panel in self.panels for line in panel.lines)


def _line(label: str, points: Series, scale: float = 1.0, style: str = "-", color: str | None = None) -> Line:
    return Line(label, [x for x, _ in points], [v / scale for _, v in points], style, color)


def memory_ranks(scalars: dict[str, Series]) -> list[int]:
    return sorted({int(m.group(1)) for tag in scalars if (m := _MEMORY_TAG.fullmatch(tag))})


def plot_specs(scalars: dict[str, Series]) -> list[PlotSpec]:
    """The report's plots, in page order; a spec whose tags are all absent has no lines (``has_data`` False)."""
    specs = []
    loss = Panel("training loss", "loss")
    if scalars.get(LOSS):
        loss.lines.append(_line("train_loss", scalars[LOSS]))
    specs.append(PlotSpec("loss", "Loss vs samples", [loss], [LOSS]))

    lr = Panel("learning rate", "lr")
    groups = sorted((int(m.group(1)), tag) for tag in scalars if (m := _LR_GROUP.fullmatch(tag)))
    for label, tag in [("group 0", LR), *((f"group {i}", tag) for i, tag in groups)]:
        if scalars.get(tag):
            lr.lines.append(_line(label, scalars[tag]))
    specs.append(PlotSpec("lr", "Learning rate vs samples", [lr], [LR]))

    panels = []
    for tag, title, ylabel in ((SAMPLES_PER_S, "samples/s", "samples / s"), (TOKENS_PER_S, "tokens/s", "tokens / s")):
        if scalars.get(tag):
            panels.append(Panel(title, ylabel, [_line(title, scalars[tag])]))
    if scalars.get(MFU):
        panels.append(Panel("MFU", "% of peak", [_line("mfu", scalars[MFU], 0.01)]))
    specs.append(PlotSpec("throughput", "Throughput vs samples", panels, [SAMPLES_PER_S, TOKENS_PER_S]))

    memory = Panel("per rank: model states, measured vs predicted (peaks dashed)", "MiB", log_y=True)
    for rank in memory_ranks(scalars):
        color = f"C{rank % 10}"  # one colour per rank: its lines differ by style
        for kind in MEMORY_KINDS:
            tag = f"Memory/rank{rank}/{kind}"
            if scalars.get(tag):
                label = f"rank {rank} {kind.removesuffix('_bytes')}"
                memory.lines.append(_line(label, scalars[tag], MIB, MEMORY_STYLES[kind], color))
    wanted = [f"Memory/rank{r}/{k}" for r in memory_ranks(scalars) for k in MEMORY_KINDS]
    specs.append(PlotSpec("memory", "Memory per rank vs samples", [memory], wanted or ["Memory/rank*/…"]))
    return specs


def missing_tags(specs: list[PlotSpec], scalars: dict[str, Series]) -> list[str]:
    """The tags the plots would draw that the run did not log (device peaks: CUDA runs only)."""
    return [tag for spec in specs for tag in spec.wanted if not scalars.get(tag)]


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError(
            "shardspeed report draws its plots with matplotlib, which is not installed: "
            "pip install 'shardspeed[monitor]' (the monitor extra: tensorboard, wandb, matplotlib)"
        ) from error
    return matplotlib


def figure(spec: PlotSpec) -> Any:
    """``spec`` as a matplotlib Figure on the Agg canvas (no pyplot: nothing global is touched)."""
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in spec.panels if p.lines]
    fig = Figure(figsize=(6.4 * max(1, len(panels)), 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(spec.title)
    for index, panel in enumerate(panels):
        axes = fig.add_subplot(1, len(panels), index + 1)
        for line in panel.lines:
            marker = "." if len(line.xs) < 30 else None
            axes.plot(line.xs, line.ys, line.style, label=line.label, marker=marker, color=line.color)
        axes.set_title(panel.title)
        axes.set_xlabel("global samples")
        axes.set_ylabel(panel.ylabel)
        if panel.log_y:
            axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        if len(panel.lines) > 1:
            axes.legend(fontsize="small")
    return fig


def render(spec: PlotSpec, out_dir: Path) -> Path:
    """Write ``spec`` as ``out_dir/<name>.png``; returns the path."""
    path = out_dir / f"{spec.name}.png"
    figure(spec).savefig(path, format="png")
    return path
