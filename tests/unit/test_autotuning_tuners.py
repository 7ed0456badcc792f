"""Tuners (autotuning/tuners.py) and the results files (autotuning/results.py). No processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardspeed.autotuning.results import TrialRow, rank_rows, write_results
from shardspeed.autotuning.space import Point
from shardspeed.autotuning.tuners import build_tuner, score

POINTS = [Point(s, mb, 1) for s in (0, 1, 2) for mb in (1, 2, 4, 8, 16, 32, 64)]


def throughput(p: Point) -> float:
    """A smooth made-up landscape: best at micro-batch 16 and stage 1."""
    return 100.0 - 8.0 * (math.log2(p.micro_batch) - 4) ** 2 - 6.0 * abs(p.stage - 1)


def _run(kind: str, early: int = 50, trials: int = 50, metric=throughput) -> list[tuple[Point, float | None]]:
    tuner = build_tuner(kind, POINTS, "throughput", early, trials, seed=1)
    while (p := tuner.next()) is not None:
        tuner.record(p, metric(p))
    return tuner.tried


def test_gridsearch_tries_everything_in_order_without_early_stopping() -> None:
    tried = _run("gridsearch")
    assert [p for p, _ in tried] == POINTS


def test_num_trials_and_early_stopping_end_a_tune() -> None:
    assert len(_run("random", trials=5)) == 5
    tuner = build_tuner("gridsearch", POINTS, "throughput", 2, 50)
    while (p := tuner.next()) is not None:
        tuner.record(p, 1.0)  # never better than the first
    assert len(tuner.tried) == 3 and "tuner_early_stopping" in tuner.stop_reason


def test_random_is_seeded_and_a_permutation() -> None:
    assert [p for p, _ in _run("random")] == [p for p, _ in _run("random")]
    assert sorted(p for p, _ in _run("random")) == sorted(POINTS)


def test_model_based_finds_the_best_in_few_trials() -> None:
    tried = _run("model_based", early=3, trials=10)
    best = max(throughput(p) for p in POINTS)
    assert len(tried) <= 10 and max(v for _, v in tried if v is not None) == best


def test_latency_is_minimised_and_failures_never_win() -> None:
    assert score(2.0, "latency") > score(3.0, "latency")
    assert score(None, "throughput") is None
    tuner = build_tuner("gridsearch", POINTS[:3], "latency", 5, 5)
    for value in (None, 3.0, 2.0):
        tuner.record(tuner.next(), value)
    assert tuner.best == -2.0


def test_unknown_tuner_is_refused() -> None:
    with pytest.raises(ValueError, match="tuner_type"):
        build_tuner("bayes", POINTS, "throughput", 1, 1)


def test_results_files_rank_trials_and_name_the_best(tmp_path: Path) -> None:
    rows = [
        TrialRow(
            "z1_mb4_gas1", Point(1, 4, 1).as_dict(), "ok", 50.0, 50.0, 3.0, 1e8, 1e7, 1.05e8, 1.01e8, None, {"a": 1}
        ),
        TrialRow(
            "z1_mb8_gas1", Point(1, 8, 1).as_dict(), "ok", 80.0, 80.0, 3.0, 1.2e8, 2e7, 1.1e8, 1.12e8, None, {"b": 2}
        ),
        TrialRow("z2_mb8_gas1", Point(2, 8, 1).as_dict(), "failed", error="exit status 1: boom"),
        TrialRow("z0_mb64_gas1", Point(0, 64, 1).as_dict(), "pruned", error="device 9 GB > budget 1 GB"),
    ]
    assert [r.name for r in rank_rows(rows)] == ["z1_mb8_gas1", "z1_mb4_gas1"]
    command = ["shardspeed", "t.py", "--deepspeed_config", "x"]
    best = write_results(tmp_path, rows, "throughput", command=command, plot=False)  # the plot: tests/e2e
    assert best is not None and best.name == "z1_mb8_gas1"
    assert json.loads((tmp_path / "ds_config_optimal.json").read_text()) == {"b": 2}
    assert (tmp_path / "cmd_optimal.txt").read_text() == "shardspeed t.py --deepspeed_config x\n"
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.index("z1_mb8_gas1") < summary.index("z1_mb4_gas1") and "boom" in summary
    assert "1 pruned" in summary and "+9.1%" in summary and "+1.8%" in summary  # predicted, fitted vs measured
    lines = (tmp_path / "trials.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[3])["status"] == "pruned"
    assert len((tmp_path / "trials.csv").read_text().splitlines()) == 5


def test_no_successful_trial_writes_no_optimal_config(tmp_path: Path) -> None:
    rows = [TrialRow("z0_mb1_gas1", Point(0, 1, 1).as_dict(), "timeout", error="still running")]
    assert write_results(tmp_path, rows, "throughput", command=["x"]) is None
    assert not (tmp_path / "ds_config_optimal.json").exists() and (tmp_path / "summary.txt").exists()


def _ac_landscape(p: Point) -> float:
    """Like the demo on CPU: bigger micro-batches are faster, activation checkpointing costs a quarter, offload a
    third, higher stages a little."""
    value = 100.0 - 6.0 * (math.log2(p.micro_batch) - 5) ** 2 - 3.0 * p.stage
    return value * (0.75 if p.checkpoint_activations else 1.0) * (0.67 if p.offload_optimizer != "none" else 1.0)


def test_model_based_is_not_misled_by_confounded_first_trials() -> None:
    """The initial design must vary every dimension independently: with the first, last and middle grid points
    the largest micro-batch was seen only with checkpointing on, and the tuner kept to checkpointed points."""
    points = [
        Point(s, mb, 1, offload, checkpoint_activations=ac)
        for s in (0, 1, 2, 3)
        for mb in (1, 4, 16, 64)
        for offload in (("none",) if s == 0 else ("none", "cpu"))
        for ac in (False, True)
    ]
    tuner = build_tuner("model_based", points, "throughput", 3, 50)
    while (p := tuner.next()) is not None:
        tuner.record(p, _ac_landscape(p))
    best = max(_ac_landscape(p) for p in points)
    found = max(v for _, v in tuner.tried if v is not None)
    assert found >= 0.95 * best and len(tuner.tried) <= 0.3 * len(points), (found, best, len(tuner.tried))
