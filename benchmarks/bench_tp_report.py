"""The tensor-parallel benchmark's report (pure: result dicts in, text out), for ``bench_tp_dtensor.py``."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from stats import median

SIDES = ("torch", "shardspeed")
SIDE_DESCRIPTIONS = {
    "torch": "torch DTensor parallelize_module (ColwiseParallel/RowwiseParallel) + torch.optim.AdamW",
    "shardspeed": "shardspeed Column/RowParallelLinear + ShardSpeedEngine ZeRO 0, config AdamW",
}
# Both sides do the same fp32 math split the same way; only reduction order (gloo's all-reduce vs shardspeed's)
# and AdamW's implementation differ, which stays far below this after a few steps.
LOSS_TOLERANCE = 1e-5


def peak_growth_mib(runs: list[dict[str, Any]], field: str = "peak_mib") -> float:
    """Median over fresh processes of the largest per-rank peak (growth over the baseline for VmHWM)."""
    per_run = []
    for run in runs:
        if field == "peak_mib":
            per_run.append(max(rank["peak_mib"] - rank["baseline_mib"] for rank in run["ranks"]))
        else:
            per_run.append(max(rank[field] for rank in run["ranks"]))
    return median(per_run)


def loss_check(check_losses: dict[str, list[float]]) -> tuple[float, float]:
    """(max |torch − shardspeed|, max |either side − dense reference|) over the checked steps."""
    torch_losses, ours, dense = check_losses["torch"], check_losses["shardspeed"], check_losses["dense"]
    between = max(abs(a - b) for a, b in zip(torch_losses, ours))
    to_dense = max(abs(a - d) for side in (torch_losses, ours) for a, d in zip(side, dense))
    return between, to_dense


def table_lines(timing: dict[str, Any], memory: dict[str, list[dict[str, Any]]]) -> list[str]:
    """side | step ms (median [min–max]) | peak MiB/rank | ratio vs torch (step, peak)."""
    field = "cuda_peak_mib" if timing["device"] == "cuda" else "peak_mib"
    header = ["side", "step ms median [min-max]", "peak MiB/rank", "ratio vs torch (step, peak)"]
    peaks = {name: peak_growth_mib(memory[name], field) if memory.get(name) else None for name in SIDES}
    rows = [header]
    for name in SIDES:
        times = timing["step_ms"][name]
        ratios = [mine / theirs for mine, theirs in zip(times, timing["step_ms"]["torch"])]
        peak, torch_peak = peaks[name], peaks["torch"]
        peak_cell = f"{peak:.1f}" if peak is not None else "-"
        peak_ratio = f"{peak / torch_peak:.2f}x" if peak is not None and torch_peak else "-"
        rows.append(
            [
                name,
                f"{median(times):.1f} [{min(times):.1f}-{max(times):.1f}]",
                peak_cell,
                f"{median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}], {peak_ratio}",
            ]
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def format_report(args: argparse.Namespace, timing: dict[str, Any], memory: dict[str, list[dict[str, Any]]]) -> str:
    between, to_dense = loss_check(timing["check_losses"])
    checked = timing["check_losses"].items()
    verdict = "agree" if between <= LOSS_TOLERANCE else "DISAGREE: the sides do not train the same model"
    memory_what = (
        "torch.cuda.max_memory_allocated per rank (tensors only), reset before the side was built"
        if timing["device"] == "cuda"
        else "growth of VmHWM (peak RSS) over its value just before the side was built, largest rank"
    )
    lines = [
        f"bench_tp_dtensor: {timing['model']} ({timing['parameters']:,} dense parameters), fp32, AdamW, TP="
        f"{timing['world']} on {timing['world']} {timing['backend']} ranks ({timing['device']}, "
        f"{timing['threads']} thread(s) each), torch {torch.__version__}",
        f"{args.repeats} rounds x {args.steps} steps per side after {args.check_steps} checked + {args.warmup} "
        f"warm-up steps; memory: "
        + (f"{args.memory_repeats} fresh process(es) per side" if args.memory_repeats else "not measured"),
        "",
        *table_lines(timing, memory),
        "",
        f"loss check over the first {args.check_steps} steps from the same weights and batches: max |torch - "
        f"shardspeed| = {between:.2e} ({verdict}; tolerance {LOSS_TOLERANCE:.0e}); max |side - single-process "
        f"dense reference| = {to_dense:.2e}",
        "losses per step: " + "; ".join(f"{name} " + " ".join(f"{v:.7f}" for v in losses) for name, losses in checked),
        "split of one step (median over steps, slowest rank), forward+backward / optimizer ms: "
        + ", ".join(f"{name} {fb:.1f} / {opt:.1f}" for name, (fb, opt) in timing["phase_ms"].items()),
        f"parameter elements held by rank 0: torch {timing['local_elements']['torch']:,}, shardspeed "
        f"{timing['local_elements']['shardspeed']:,} (dense model {timing['parameters']:,})",
        "",
        "step ms = mean step time of a round's timed block (barrier-synchronized, slowest rank); median and range "
        "over rounds, the side order alternating per round; step ratio = shardspeed/torch per round (median "
        "[min-max]).",
        f"peak MiB/rank = {memory_what}; median over fresh processes. Peak ratio = shardspeed/torch.",
    ]
    for name in SIDES:
        if memory.get(name):
            ranks = range(len(memory[name][0]["ranks"]))
            absolute = [median([run["ranks"][r]["peak_mib"] for run in memory[name]]) for r in ranks]
            lines.append(f"{name}: absolute VmHWM per rank " + " / ".join(f"{v:.0f}" for v in absolute) + " MiB")
    for name in SIDES:
        lines.append(
            f"{name}: {SIDE_DESCRIPTIONS[name]}; ms per round: " + " ".join(f"{v:.1f}" for v in timing["step_ms"][name])
        )
    return "\n".join(lines)
