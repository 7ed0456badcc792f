"""Format the benchmark's results as the final plain-text table (pure: dicts in, text out)."""

from __future__ import annotations

from typing import Any

from stats import median, summarize_ratios

MEMORY_NOTE = (
    "peak RSS = VmHWM (/proc/self/status) of each rank, in MiB, from a separate torchrun per row that builds "
    "only that row and runs warmup + steps steps. Each such process first imports the libraries of all rows in "
    "the run and triggers torch's lazy one-time setup on a 1-element tensor, so the peak also holds torch, those "
    "imports, the template model and the batch, equally for every row. In parentheses: growth over the VmHWM "
    "just before the row was built, i.e. the row's own model copy, gradients, optimizer state, communication "
    "buffers and activations."
)


# An IQR wider than this cannot support claims like "within 2%" (the target is about the median ratio).
NOISY_IQR_WIDTH = 0.05


def _memory_cell(memory: dict[str, dict[str, Any] | None], name: str) -> str:
    if name not in memory:
        return "-"
    if memory[name] is None:
        return "memory run failed"
    row = memory[name]
    peaks = " / ".join(f"{value:.0f}" for value in row["peak_mib"])
    growth = " / ".join(f"+{peak - base:.0f}" for peak, base in zip(row["peak_mib"], row["baseline_mib"]))
    return f"{peaks} ({growth})"


def table_rows(timing: dict[str, Any], memory: dict[str, dict[str, Any] | None]) -> list[list[str]]:
    """One list of cells per row: name, peer, median step ms, ratio median, IQR, peak RSS, final loss."""
    step_ms: dict[str, list[float]] = timing["step_ms"]
    cells = []
    for row in timing["rows"]:
        name, peer = row["name"], row["peer"]
        ratio, band = "-", "-"
        if peer is not None and peer in step_ms:
            summary = summarize_ratios(step_ms[name], step_ms[peer])
            ratio = f"{summary.median:.3f}×"
            band = f"{summary.q25:.3f}-{summary.q75:.3f}×"
        cells.append(
            [
                name,
                peer or "-",
                f"{median(step_ms[name]):.1f}",
                ratio,
                band,
                _memory_cell(memory, name),
                f"{timing['final_loss'][name]:.6f}",
            ]
        )
    return cells


# fp32 rows that do the same math differ only in summation order (bucketing, reduce-scatter vs all-reduce); after
# tens of steps that leaves differences around 1e-6 on a loss near 5. Beyond this, the rows train differently.
LOSS_AGREEMENT_TOLERANCE = 1e-4


def loss_agreement(final_loss: dict[str, float], name: str, peer: str) -> str:
    """One line saying whether ``name`` and ``peer`` ended at the same loss (they do the same math)."""
    difference = abs(final_loss[name] - final_loss[peer])
    verdict = "agree" if difference <= LOSS_AGREEMENT_TOLERANCE else "DISAGREE: the rows train differently"
    return f"|loss - {peer} loss| = {difference:.1e} ({verdict}; tolerance {LOSS_AGREEMENT_TOLERANCE:.0e})"


HEADER = ["row", "peer", "step ms (median)", "ratio median", "IQR", "peak RSS MiB/rank (+row)", "loss"]


def format_report(timing: dict[str, Any], memory: dict[str, dict[str, Any] | None]) -> str:
    """The final table, per-round ratios, and notes on what was measured."""
    body = table_rows(timing, memory)
    widths = [max(len(line[column]) for line in [HEADER, *body]) for column in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [HEADER, *body]]
    lines.append("")
    for row in timing["rows"]:
        name, peer = row["name"], row["peer"]
        if peer is not None and peer in timing["step_ms"]:
            summary = summarize_ratios(timing["step_ms"][name], timing["step_ms"][peer])
            lines.append(f"{name}/{peer} per round: " + " ".join(f"{value:.3f}" for value in summary.per_round))
            lines.append(f"  {loss_agreement(timing['final_loss'], name, peer)}")
            if summary.q75 - summary.q25 > NOISY_IQR_WIDTH:
                lines.append(
                    f"  noisy: the IQR is {summary.q75 - summary.q25:.3f} wide, too wide to resolve a few percent; "
                    "rerun on an idle machine or with more, shorter rounds (e.g. --rounds 15 --steps 6)"
                )
    for row in timing["rows"]:
        lines.append(
            f"{row['name']}: {row['description']}; ms per round: "
            + " ".join(f"{value:.1f}" for value in timing["step_ms"][row["name"]])
        )
    lines.append("")
    lines.append(
        "step ms = mean step time of each round's timed block (barrier-synchronized, slowest rank), median "
        "over rounds; ratio = row/peer per round (round order alternates), median and 25th-75th percentile "
        "over rounds."
    )
    lines.append(MEMORY_NOTE if memory else "peak RSS: not measured (run without torchrun to measure it per row).")
    lines.append(
        "loss = rank 0's loss at the last step: rows start from the same weights and data and take the same "
        "number of steps, so equal losses show they train the same thing."
    )
    for name, reason in timing.get("skipped", {}).items():
        lines.append(f"{name}: skipped ({reason})")
    return "\n".join(lines)
