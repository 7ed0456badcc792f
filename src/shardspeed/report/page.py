"""The report's ``index.html``: the plots (by relative path: the page and its PNGs travel together as one folder,
and each PNG stays usable on its own), a table of every logged tag, the config and the profiler summary."""

from __future__ import annotations

import html
import json
from pathlib import Path

from shardspeed.report.plots import PlotSpec
from shardspeed.report.scalars import RunData

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; color: #222; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.missing { color: #a33; }
"""


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def _tags_table(data: RunData) -> str:
    rows = ["<tr><th>tag</th><th>points</th><th>first x</th><th>last x</th><th>first</th><th>last</th></tr>"]
    for tag in sorted(data.scalars):
        points = data.scalars[tag]
        if not points:
            continue
        (x0, v0), (x1, v1) = points[0], points[-1]
        cells = [html.escape(tag), str(len(points)), str(x0), str(x1), _fmt(v0), _fmt(v1)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "<table>" + "\n".join(rows) + "</table>"


def _config_block(path: Path | None) -> str:
    if path is None:
        return '<p class="missing">No ds_config.json was found under the run directory.</p>'
    text = path.read_text()
    try:
        text = json.dumps(json.loads(text), indent=2, sort_keys=False)
    except json.JSONDecodeError as error:
        text = f"(not valid JSON: {error})\n{text}"
    return f"<p>From <code>{html.escape(str(path))}</code>:</p><pre>{html.escape(text)}</pre>"


def _profile_block(path: Path | None) -> str:
    if path is None:
        return '<p class="missing">No flops_profile.txt was found under the run directory.</p>'
    return f"<p>From <code>{html.escape(str(path))}</code>:</p><pre>{html.escape(path.read_text())}</pre>"


def page(run_dir: Path, data: RunData, written: list[PlotSpec], specs: list[PlotSpec], missing: list[str]) -> str:
    """The HTML text. ``written``: the plots that had data (PNG next to the page); ``missing``: absent tags."""
    source = {
        "csv": "CSV files (csv_monitor layout)",
        "tensorboard": "TensorBoard event files (read with tensorboard's EventAccumulator)",
        "none": "nothing: no CSV or TensorBoard files were found",
    }[data.source]
    files = "".join(f"<li><code>{html.escape(str(p))}</code></li>" for p in data.source_files[:20])
    more = f"<li>… {len(data.source_files) - 20} more</li>" if len(data.source_files) > 20 else ""
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>shardspeed report</title>',
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>shardspeed report: {html.escape(run_dir.name or str(run_dir))}</h1>",
        f"<p>Run directory <code>{html.escape(str(run_dir))}</code>; scalars from {source}.</p>",
        f"<details><summary>{len(data.source_files)} source file(s)</summary><ul>{files}{more}</ul></details>",
        "<h2>Plots</h2>",
        "<p>x is the number of global samples consumed (all data-parallel ranks).</p>",
    ]
    for spec in specs:
        if spec in written:
            parts.append(f'<h3>{html.escape(spec.title)}</h3><img src="{spec.name}.png" alt="{spec.name}">')
        else:
            parts.append(f'<h3>{html.escape(spec.title)}</h3><p class="missing">Not drawn: no data.</p>')
    if missing:
        items = "".join(f"<li><code>{html.escape(tag)}</code></li>" for tag in missing)
        parts.append(
            '<h2>Missing tags</h2><p class="missing">These tags were not logged by the run (device peaks are logged '
            f"on CUDA only; tokens/s only when tokens per sample are known):</p><ul>{items}</ul>"
        )
    parts += [
        "<h2>Every logged tag</h2>",
        _tags_table(data) if data.scalars else '<p class="missing">No scalars.</p>',
        "<h2>Config</h2>",
        _config_block(data.config_path),
        "<h2>Flops profiler</h2>",
        _profile_block(data.profile_path),
        "</body></html>",
    ]
    return "\n".join(parts)
