"""Format the benchmark's results as the final plain-text table (pure: dicts in, text out)."""

from __future__ import annotations

from typing import Any

from bench_exposed import CATEGORIES, summarize
from stats import median, summarize_ratios

CUDA_MEMORY_NOTE = (
    "peak CUDA MiB = torch.cuda.max_memory_allocated of each rank, from a separate torchrun per row that builds "
    "only that row and runs warmup + steps steps; in parentheses: growth over the allocation just before the row "
    "was built (the row's own model copy, gradients, optimizer state, buffers and activations)."
)

MEMORY_NOTE = (
    "peak RSS = VmHWM (/proc/self/status) of each rank, in MiB, from a separate torchrun per row that builds "
    "only that row and runs warmup + steps steps. Each such process first imports the libraries of all rows in "
    "the run and triggers torch's lazy one-time setup on a 1-element tensor, so the peak also holds torch, those "
    "imports, the template model and the batch, equally for every row. In parentheses: growth over the VmHWM "
    "just before the row was built, i.e. the row's own model copy, gradients, optimizer state, communication "
    "buffers and activations."
)


BEFORE_SUFFIX = "_before"  # "stage1_before" is stage1 as before issue #16 (bench_rows.py)

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


def target_verdict(ratio_median: float, target: float | None) -> str:
    """``"≤ 0.95 met"`` / ``"≤ 0.95 NOT met"`` for a median ratio against issue #16's bound; ``-`` without one.

    The bound is on the median of the paired ratios; the IQR beside it says how sure that is.
    """
    if target is None:
        return "-"
    return f"≤ {target:.2f} {'met' if ratio_median <= target else 'NOT met'}"


def _exposed_cell(timing: dict[str, Any], name: str) -> str:
    rounds = timing.get("blocked_ms", {}).get(name)
    if not rounds:
        return "-"
    groups, _ = summarize(rounds)
    return f"{groups['total']:.1f}"


def table_rows(timing: dict[str, Any], memory: dict[str, dict[str, Any] | None]) -> list[list[str]]:
    """One list of cells per row: name, peer, median step ms, ratio median, IQR, target, exposed comm ms/step,
    peak memory, final loss."""
    step_ms: dict[str, list[float]] = timing["step_ms"]
    cells = []
    for row in timing["rows"]:
        name, peer = row["name"], row["peer"]
        ratio, band, verdict = "-", "-", "-"
        if peer is not None and peer in step_ms:
            summary = summarize_ratios(step_ms[name], step_ms[peer])
            ratio = f"{summary.median:.3f}×"
            band = f"{summary.q25:.3f}-{summary.q75:.3f}×"
            verdict = target_verdict(summary.median, row.get("target"))
        cells.append(
            [
                name,
                peer or "-",
                f"{median(step_ms[name]):.1f}",
                ratio,
                band,
                verdict,
                _exposed_cell(timing, name),
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


HEADER = [
    "row",
    "peer",
    "step ms (median)",
    "ratio median",
    "IQR",
    "target",
    "exposed comm ms/step",
    "peak MiB/rank (+row)",
    "loss",
]


def _aligned(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(line[column]) for line in [header, *body]) for column in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *body]]


EXPOSED_HEADER = ["row", "total", *CATEGORIES, "by op:tag (ms/step, median over rounds)"]


def exposed_lines(timing: dict[str, Any]) -> list[str]:
    """The exposed-communication table (shardspeed rows), then each before/after pair's step-time ratio."""
    blocked: dict[str, list[dict[str, float]]] = timing.get("blocked_ms", {})
    names = [row["name"] for row in timing["rows"] if blocked.get(row["name"])]
    if not names:
        return []
    body = []
    for name in names:
        groups, keys = summarize(blocked[name])
        detail = ", ".join(f"{key} {ms:.2f}" for key, ms in sorted(keys.items(), key=lambda kv: -kv[1]) if ms >= 0.005)
        body.append([name, *(f"{groups[group]:.2f}" for group in ("total", *CATEGORIES)), detail or "-"])
    lines = ["exposed communication, ms per step (time blocked in wait() or synchronous collectives, mean of ranks):"]
    lines += _aligned(EXPOSED_HEADER, body)
    for before, after in before_after_pairs(names, list(timing["step_ms"])):
        summary = summarize_ratios(timing["step_ms"][after], timing["step_ms"][before])
        was, now = summarize(blocked[before])[0]["total"], summarize(blocked[after])[0]["total"]
        lines.append(
            f"{after} after/before: step time {summary.median:.3f}× (IQR {summary.q25:.3f}-{summary.q75:.3f}), "
            f"exposed comm {was:.2f} -> {now:.2f} ms/step"
        )
    return lines


def before_after_pairs(with_meter: list[str], timed: list[str]) -> list[tuple[str, str]]:
    """(before, after) names where both rows were timed and metered: ``stage1_before`` pairs with ``stage1``."""
    return [(name + BEFORE_SUFFIX, name) for name in with_meter if name + BEFORE_SUFFIX in with_meter and name in timed]


def format_report(timing: dict[str, Any], memory: dict[str, dict[str, Any] | None], *, notes: bool = True) -> str:
    """The final table, per-round ratios, and (``notes``) what was measured: a second table of the same run
    (DeepSpeed's process set) leaves the notes to the first."""
    lines = _aligned(HEADER, table_rows(timing, memory))
    lines.append("")
    exposed = exposed_lines(timing)
    if exposed:
        lines += [*exposed, ""]
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
    skipped = [f"{name}: skipped ({reason})" for name, reason in timing.get("skipped", {}).items()]
    if not notes:
        return "\n".join([*lines, *skipped])
    lines.append("")
    lines.append(
        "step ms = mean step time of each round's timed block (barrier-synchronized, slowest rank), median "
        "over rounds; ratio = row/peer per round (round order alternates), median and 25th-75th percentile "
        "over rounds; target = issue #16's bound on the median ratio (met: the median is at or under it)."
    )
    lines.append(
        "exposed comm = wall time per step the training thread sat blocked in a Work.wait() or a synchronous "
        "collective (engine.collectives.blocked, reset before each timed block), mean over ranks, median over "
        "rounds; grads / params / other by the collective's tag."
    )
    cuda = any(cell and cell.get("device") == "cuda" for cell in memory.values())
    lines.append(
        (CUDA_MEMORY_NOTE if cuda else MEMORY_NOTE)
        if memory
        else "peak memory: not measured (--skip-memory, or a rank run directly under torchrun)."
    )
    lines.append(
        "loss = rank 0's loss at the last step: rows start from the same weights and data and take the same "
        "number of steps, so equal losses show they train the same thing."
    )
    return "\n".join([*lines, *skipped])


def format_cross_set(timing: dict[str, Any], deepspeed: dict[str, Any]) -> str:
    """DeepSpeed against shardspeed across the two process sets, through the peer both were paired with.

    Nothing pairs rounds across process sets (they ran one after the other), so the comparison divides the two
    sets' median ratios to their common peer: (deepspeedN / peer) / (stageN / peer). The loss difference is
    direct: both sets start from the same weights and data and take the same number of steps.
    """
    lines = ["DeepSpeed vs shardspeed through the common peer (medians of each set; not paired across sets):"]
    for row in deepspeed["rows"]:
        name, peer = row["name"], row["peer"]
        mine = "stage" + name.removeprefix("deepspeed")
        if not name.startswith("deepspeed") or peer is None or mine not in timing["step_ms"]:
            continue
        if peer not in timing["step_ms"] or peer not in deepspeed["step_ms"]:
            continue
        theirs = summarize_ratios(deepspeed["step_ms"][name], deepspeed["step_ms"][peer]).median
        ours = summarize_ratios(timing["step_ms"][mine], timing["step_ms"][peer]).median
        loss_gap = abs(deepspeed["final_loss"][name] - timing["final_loss"][mine])
        lines.append(
            f"  {mine} / {name} = {ours:.3f} / {theirs:.3f} = {ours / theirs:.3f}× "
            f"(via {peer}); |loss - {name} loss| = {loss_gap:.1e}"
        )
    return "\n".join(lines)
