"""The table ``bench_pipe.py`` prints (pure: a results dict in, text out)."""

from __future__ import annotations

from typing import Any

from stats import interquartile_range, median, per_round_ratios

SIDES = ("shardspeed-1f1b", "shardspeed-gpipe", "torch-1f1b", "torch-gpipe")
DEEPSPEED_SIDE = "deepspeed-1f1b"
PEERS = {"shardspeed-1f1b": "torch-1f1b", "shardspeed-gpipe": "torch-gpipe"}


def _spread(values: list[float], fmt: str = "{:.1f}") -> str:
    lo, hi = interquartile_range(values)
    return f"{fmt.format(median(values))} [{fmt.format(lo)}–{fmt.format(hi)}]"


def _column(rounds: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rounds]


def _memory_cell(report: dict[str, Any], side: str, m: int) -> str:
    if side == DEEPSPEED_SIDE:
        ds = report.get("deepspeed") or {}
        entry = ds.get("by_m", {}).get(str(m))
        return "" if not entry else f"{max(entry['growth_mib']):.0f}"
    runs = report["memory"].get(side) or []
    if not runs or runs[0]["micro_batches"] != m:
        return ""
    return f"{median([max(r['growth_mib']) for r in runs]):.0f}"


def format_report(report: dict[str, Any]) -> str:
    timing = report["timing"]
    ds = report.get("deepspeed")
    lines = [f"PP=2 on world {timing['world']} (gloo, CPU), model: {timing['model']}"]
    lines.append(
        "step ms: median [IQR] over rounds, slowest rank; bubble: Σ stage idle / (2 × step), idle = time blocked "
        "in p2p waits; p2p: time posting; memory: peak-RSS growth (MiB), fresh process, max over ranks"
    )
    for m_key, entry in timing["by_m"].items():
        m = int(m_key)
        theory = 1 / (m + 1)
        lines.append("")
        lines.append(f"m = {m} micro-batches (theoretical bubble (p-1)/(m+p-1) = {theory:.3f})")
        header = f"{'side':<18} {'step ms':>22} {'bubble':>8} {'idle ms':>9} {'p2p ms':>8} {'mem MiB':>8}  ratios"
        lines.append(header)
        rows = dict(entry["rounds"])
        ds_entry = (ds or {}).get("by_m", {}).get(m_key)
        if ds_entry:
            rows[DEEPSPEED_SIDE] = ds_entry["rounds"]
        ds_median = median(_column(ds_entry["rounds"], "step_ms")) if ds_entry else None
        for side, rounds in rows.items():
            step = _column(rounds, "step_ms")
            ratios = []
            peer = PEERS.get(side)
            if peer and peer in entry["rounds"]:
                per_round = per_round_ratios(step, _column(entry["rounds"][peer], "step_ms"))
                ratios.append(f"/{peer} {_spread(per_round, '{:.2f}')} (per round)")
            if ds_median and side.startswith("shardspeed"):
                ratios.append(f"/deepspeed {median(step) / ds_median:.2f} (medians)")
            lines.append(
                f"{side:<18} {_spread(step):>22} {median(_column(rounds, 'bubble')):>8.3f} "
                f"{median(_column(rounds, 'wait_ms')):>9.1f} {median(_column(rounds, 'post_ms')):>8.1f} "
                f"{_memory_cell(report, side, m):>8}  {'; '.join(ratios)}"
            )
        if not ds_entry:
            lines.append(
                f"{DEEPSPEED_SIDE:<18} DeepSpeed: not installed (--deepspeed-python / $SHARDSPEED_DEEPSPEED_PYTHON)"
            )
        losses = {**entry["first_losses"], **({DEEPSPEED_SIDE: ds_entry["first_losses"]} if ds_entry else {})}
        lines.append("first two losses (same weights, same data): " + "; ".join(
            f"{side} {', '.join(f'{v:.5f}' for v in vals)}" for side, vals in losses.items()
        ))  # fmt: skip
        if ds_entry:
            lines.append(f"DeepSpeed {ds.get('version', '?')} partition: {ds_entry['parts']}")
    return "\n".join(lines)
