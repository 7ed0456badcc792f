"""The tensor-parallel benchmark against torch DTensor (``benchmarks/bench_tp_dtensor.py``).

Pure parts without processes: the shared plan slices the dense model as both sides must (each rank's pieces put
back together are the dense weights), the report's arithmetic, and bad ``--tp`` refused by name. Then the script
itself end to end at tiny size on two gloo ranks: both sides train, their losses agree with each other and with the
dense reference, and each rank holds a slice (fewer elements than the dense model); those runs start processes
(a minute or more on 2 shared cores) and are under the slow marker.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SRC = BENCHMARKS.parent / "src"
sys.path.insert(0, str(BENCHMARKS))

from bench_tp_dtensor import parse_args  # noqa: E402
from bench_tp_report import format_report, loss_check, peak_growth_mib, table_lines  # noqa: E402
from tp_model import TP_MODEL_SIZES, TP_PLAN, build_dense, slice_for_shardspeed  # noqa: E402

from shardspeed.tensor_parallel import TensorParallel  # noqa: E402
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from shardspeed.topology import AxisGroup  # noqa: E402


def _tensor_parallel(rank: int, size: int) -> TensorParallel:
    # Slicing needs only this rank's index and the axis size; no collective runs before forward.
    return TensorParallel(AxisGroup("tensor", None, tuple(range(size)), rank))


def test_the_plan_slices_every_planned_linear_and_the_slices_reassemble_the_dense_weights() -> None:
    size = TP_MODEL_SIZES["tiny"]
    dense = build_dense(size)
    slices = [slice_for_shardspeed(build_dense(size), _tensor_parallel(rank, 2)) for rank in range(2)]
    for name, split in TP_PLAN.items():
        reference: nn.Linear = dense.blocks[0].get_submodule(name)
        pieces = [model.blocks[0].get_submodule(name) for model in slices]
        layer_type = ColumnParallelLinear if split == "column" else RowParallelLinear
        assert all(type(piece) is layer_type for piece in pieces), name
        dim = 0 if split == "column" else 1  # nn.Linear's [out, in]: column splits outputs, row splits inputs
        assert all(piece.weight.shape[dim] * 2 == reference.weight.shape[dim] for piece in pieces), name
        assert torch.equal(torch.cat([piece.weight for piece in pieces], dim=dim), reference.weight), name
        if split == "column":
            assert torch.equal(torch.cat([piece.bias for piece in pieces]), reference.bias), name
        else:  # a row-parallel bias is added once, after the sum: replicated
            assert all(torch.equal(piece.bias, reference.bias) for piece in pieces), name
    # Everything outside the plan stays replicated, and the LM head stays tied to the token embedding.
    for model in slices:
        assert torch.equal(model.token_embedding.weight, dense.token_embedding.weight)
        assert model.lm_head.weight is model.token_embedding.weight


def test_a_head_count_the_tensor_parallel_size_does_not_divide_is_refused_naming_it(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny", "--tp", "4"])
    assert "n_head 2 is not divisible by the tensor-parallel size 4" in capsys.readouterr().err


def _memory(side_peaks: list[list[tuple[float, float]]]) -> list[dict]:
    return [{"ranks": [{"baseline_mib": b, "peak_mib": p} for b, p in run]} for run in side_peaks]


def test_the_loss_check_and_the_memory_figure_are_worked_out_exactly() -> None:
    between, to_dense = loss_check({"torch": [5.0, 4.0], "shardspeed": [5.0, 4.25], "dense": [5.5, 4.0]})
    assert (between, to_dense) == (0.25, 0.5)
    # Largest rank's growth per process (30, 20, 50), then the median over processes.
    runs = _memory([[(100.0, 130.0), (100.0, 110.0)], [(90.0, 110.0), (95.0, 100.0)], [(10.0, 60.0), (0.0, 1.0)]])
    assert peak_growth_mib(runs) == 30.0


def test_the_table_has_one_row_per_side_with_median_range_peak_and_ratios() -> None:
    timing = {
        "device": "cpu",
        "step_ms": {"torch": [10.0, 20.0, 30.0], "shardspeed": [5.0, 30.0, 15.0]},
    }
    memory = {"torch": _memory([[(0.0, 40.0)]]), "shardspeed": _memory([[(0.0, 30.0)]])}
    lines = table_lines(timing, memory)
    assert re.split(r"\s{2,}", lines[1]) == ["torch", "20.0 [10.0-30.0]", "40.0", "1.000x [1.000-1.000], 1.00x"]
    # Per-round ratios 0.5, 1.5, 0.5: median 0.5.
    assert re.split(r"\s{2,}", lines[2]) == ["shardspeed", "15.0 [5.0-30.0]", "30.0", "0.500x [0.500-1.500], 0.75x"]
    args = argparse.Namespace(repeats=3, steps=1, check_steps=2, warmup=0, memory_repeats=1)
    report = format_report(
        args,
        {
            **timing,
            "check_losses": {"torch": [5.0, 4.0], "shardspeed": [5.0, 4.0], "dense": [5.0, 4.0]},
            "local_elements": {"torch": 7, "shardspeed": 7},
            "phase_ms": {"torch": [1.0, 2.0], "shardspeed": [1.5, 0.5]},
            "model": "m",
            "parameters": 10,
            "world": 2,
            "threads": 1,
            "backend": "gloo",
        },
        memory,
    )
    assert "max |torch - shardspeed| = 0.00e+00 (agree" in report
    assert "forward+backward / optimizer ms: torch 1.0 / 2.0, shardspeed 1.5 / 0.5" in report


def _run_bench(*arguments: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, str(BENCHMARKS / "bench_tp_dtensor.py"), "--model", "tiny", *arguments]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return result, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"


def _check_common(result: subprocess.CompletedProcess[str], report: str) -> None:
    assert result.returncode == 0, report
    gap = re.search(r"max \|torch - shardspeed\| = (\S+) \(agree", result.stdout)
    to_dense = re.search(r"max \|side - single-process dense reference\| = (\S+)", result.stdout)
    assert gap and to_dense, report
    assert float(gap.group(1)) <= 1e-5 and float(to_dense.group(1)) <= 1e-5, report
    held = re.search(r"held by rank 0: torch ([\d,]+), shardspeed ([\d,]+) \(dense model ([\d,]+)\)", result.stdout)
    assert held, report
    torch_held, ours, dense = (int(value.replace(",", "")) for value in held.groups())
    assert torch_held == ours < dense, report  # both sides hold the same slice, smaller than the dense model
    assert re.search(r"optimizer ms: torch [\d.]+ / [\d.]+, shardspeed [\d.]+ / [\d.]+", result.stdout), report


@pytest.mark.slow  # about a minute on 2 shared cores: two ranks importing torch, DTensor and shardspeed
@pytest.mark.timeout(240)
def test_the_benchmark_runs_both_sides_at_tp2_and_their_losses_agree() -> None:
    result, report = _run_bench(
        "--repeats", "1", "--steps", "1", "--warmup", "0", "--check-steps", "2", "--memory-repeats", "0", timeout=230
    )
    _check_common(result, report)
    assert re.search(r"^torch\s+[\d.]+ \[[\d.]+-[\d.]+\]\s+-\s+1\.000x", result.stdout, re.M), report
    assert re.search(r"^shardspeed\s+[\d.]+ \[[\d.]+-[\d.]+\]\s+-\s+[\d.]+x", result.stdout, re.M), report


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_full_benchmark_measures_peak_memory_in_fresh_processes_per_side() -> None:
    result, report = _run_bench(
        "--repeats", "2", "--steps", "2", "--warmup", "1", "--check-steps", "2", "--memory-repeats", "1", timeout=390
    )
    _check_common(result, report)
    for side in ("torch", "shardspeed"):
        assert re.search(rf"^{side}\s+[\d.]+ \[[\d.]+-[\d.]+\]\s+[\d.]+\s+[\d.]+x \[", result.stdout, re.M), report
