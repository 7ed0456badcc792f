"""The benchmark's pure helpers: percentiles, per-round ratios, /proc status parsing.

Expected values are worked out by hand (and percentiles also cross-checked against numpy's default method).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_report import format_report, loss_agreement, table_rows
from proc_status import parse_status_kib
from stats import (
    interquartile_range,
    mean,
    median,
    per_round_ratios,
    percentile,
    summarize_ratios,
)


def test_median_odd_and_even_counts() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5  # mean of the two middle values 2 and 3
    assert median([7.0]) == 7.0


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    # position = q/100 * (n - 1): 25% -> index 1 exactly, 10% -> index 0.4 -> 10 + 0.4 * 10
    assert percentile(values, 25) == 20.0
    assert percentile(values, 10) == pytest.approx(14.0)
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 50.0
    assert percentile([5.0, 1.0], 50) == 3.0  # unsorted input is sorted first


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 11])
@pytest.mark.parametrize("q", [0, 12.5, 25, 50, 75, 90, 100])
def test_percentile_matches_numpy_linear(count: int, q: float) -> None:
    values = list(np.random.default_rng(count).normal(100.0, 15.0, size=count))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_interquartile_range_of_known_values() -> None:
    # 1..9: 25th percentile at index 2 (value 3), 75th at index 6 (value 7)
    assert interquartile_range([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 4.0, 6.0, 8.0]) == (3.0, 7.0)
    # four values: positions 0.75 and 2.25
    low, high = interquartile_range([1.0, 2.0, 4.0, 8.0])
    assert low == pytest.approx(1.75) and high == pytest.approx(5.0)


def test_per_round_ratios_and_summary() -> None:
    row = [98.0, 105.0, 99.0, 120.0, 100.0]
    peer = [100.0, 100.0, 100.0, 100.0, 80.0]
    assert per_round_ratios(row, peer) == pytest.approx([0.98, 1.05, 0.99, 1.2, 1.25])
    summary = summarize_ratios(row, peer)
    # sorted ratios 0.98, 0.99, 1.05, 1.20, 1.25: median 1.05, quartiles at indexes 1 and 3
    assert summary.median == pytest.approx(1.05)
    assert (summary.q25, summary.q75) == pytest.approx((0.99, 1.2))
    assert summary.per_round == pytest.approx((0.98, 1.05, 0.99, 1.2, 1.25))


def test_mean() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0


def test_bad_inputs_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="values is empty"):
        median([])
    with pytest.raises(ValueError, match=r"q=101.*0 <= q <= 100"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="non-finite"):
        median([1.0, float("nan")])
    with pytest.raises(ValueError, match="row_times has 2 rounds but peer_times has 3"):
        per_round_ratios([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"peer_times\[1\] = 0.0"):
        per_round_ratios([1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="peer_times is empty"):
        summarize_ratios([1.0], [])


STATUS_SAMPLE = """Name:\tpython
VmPeak:\t  812340 kB
VmHWM:\t  412345 kB
VmRSS:\t  398001 kB
Threads:\t3
"""


def test_parse_status_fields() -> None:
    assert parse_status_kib(STATUS_SAMPLE, "VmHWM") == 412345
    assert parse_status_kib(STATUS_SAMPLE, "VmRSS") == 398001
    with pytest.raises(KeyError, match="VmSwap"):
        parse_status_kib(STATUS_SAMPLE, "VmSwap")
    with pytest.raises(ValueError, match="Threads"):
        parse_status_kib(STATUS_SAMPLE, "Threads")  # present, but not a 'kB' field


def test_report_rows_pair_each_row_with_its_peer() -> None:
    timing = {
        "rows": [{"name": "stage0", "peer": "ddp"}, {"name": "ddp", "peer": None}],
        "step_ms": {"stage0": [95.0, 110.0, 90.0], "ddp": [100.0, 100.0, 100.0]},
        "final_loss": {"stage0": 1.25, "ddp": 1.25},
    }
    memory = {"stage0": {"peak_mib": [400.0, 398.0], "baseline_mib": [250.0, 250.0]}, "ddp": None}
    stage0, ddp = table_rows(timing, memory)
    # ratios 0.95, 1.10, 0.90 -> sorted 0.90, 0.95, 1.10: median 0.95, quartiles 0.925 and 1.025
    assert stage0[:5] == ["stage0", "ddp", "95.0", "0.950×", "0.925-1.025×"]
    assert stage0[5:7] == ["-", "-"]  # no target given, no blocked meter
    assert stage0[7] == "400 / 398 (+150 / +148)"
    assert ddp[:5] == ["ddp", "-", "100.0", "-", "-"]
    assert ddp[7] == "memory run failed"


def test_report_flags_a_noisy_ratio_band() -> None:
    rows = [{"name": "stage0", "peer": "ddp", "description": "a"}, {"name": "ddp", "peer": None, "description": "b"}]
    quiet = {"rows": rows, "step_ms": {"stage0": [99.0, 101.0], "ddp": [100.0, 100.0]}, "final_loss": {}}
    quiet["final_loss"] = {"stage0": 1.0, "ddp": 1.0}
    # ratios 0.99 and 1.01: IQR 0.995-1.005, 0.01 wide
    assert "noisy" not in format_report(quiet, {})
    noisy = {**quiet, "step_ms": {"stage0": [80.0, 120.0], "ddp": [100.0, 100.0]}}
    # ratios 0.8 and 1.2: IQR 0.9-1.1, 0.2 wide
    assert "noisy: the IQR is 0.200 wide" in format_report(noisy, {})


def test_loss_agreement_flags_rows_that_train_differently() -> None:
    losses = {"stage3": 4.8634021, "fsdp2": 4.8634030, "broken": 4.9}
    # 4.8634030 - 4.8634021 = 9e-7: summation-order noise, well inside 1e-4
    assert "= 9.0e-07 (agree" in loss_agreement(losses, "stage3", "fsdp2")
    # 4.9 - 4.8634030 = 0.036597
    assert "= 3.7e-02 (DISAGREE" in loss_agreement(losses, "broken", "fsdp2")


def test_report_prints_the_loss_difference_under_each_ratio() -> None:
    rows = [{"name": "stage0", "peer": "ddp", "description": "a"}, {"name": "ddp", "peer": None, "description": "b"}]
    timing = {"rows": rows, "step_ms": {"stage0": [1.0], "ddp": [1.0]}, "final_loss": {"stage0": 2.5, "ddp": 2.5}}
    assert "|loss - ddp loss| = 0.0e+00 (agree" in format_report(timing, {})


def test_every_row_has_a_known_peer_and_the_default_shows_every_stage() -> None:
    from bench_rows import DEEPSPEED_ROWS, DEFAULT_ROWS, ROWS, resolve_rows

    assert all(row.peer is None or row.peer in ROWS for row in ROWS.values())
    expected_pairs = {"stage0": "ddp", "stage1": "zero_redundancy", "stage2": "ddp", "stage3": "fsdp2"}
    assert {name: ROWS[name].peer for name in expected_pairs} == expected_pairs
    assert set(expected_pairs) | {"ddp", "zero_redundancy", "fsdp2"} <= set(DEFAULT_ROWS)
    assert not set(DEEPSPEED_ROWS) & set(DEFAULT_ROWS)
    # a row's peer is added after it when not requested
    assert [row.name for row in resolve_rows(["stage2"])] == ["stage2", "ddp"]
    with pytest.raises(ValueError, match="unknown row 'stage4'"):
        resolve_rows(["stage4"])
