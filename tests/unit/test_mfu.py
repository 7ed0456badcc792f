"""MFU (profiling/mfu.py): the pure formula, the datasheet table's name matching, the CPU probe's cache."""

from __future__ import annotations

import pytest
import torch

from shardspeed.profiling import mfu
from shardspeed.profiling.mfu import PeakFlops, model_flops_utilization, peak_flops, precision_name, table_peak


def test_mfu_is_achieved_over_peak() -> None:
    # 6e9 flops/sample × 1000 samples/s on 4 devices of 3e12 → 6e12 / 12e12
    assert model_flops_utilization(6e9, 1000.0, 4, 3e12) == 0.5
    assert model_flops_utilization(0.0, 1000.0, 1, 1e12) == 0.0


@pytest.mark.parametrize(
    ("args", "culprit"),
    [((1.0, 1.0, 0, 1e12), "devices"), ((1.0, 1.0, 1, 0.0), "peak"), ((-1.0, 1.0, 1, 1e12), "model_flops")],
)
def test_mfu_bad_input_names_it(args: tuple, culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        model_flops_utilization(*args)


@pytest.mark.parametrize(
    ("name", "precision", "tflops", "label"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5, "H100 SXM"),
        ("NVIDIA H100 PCIe", "bf16", 756, "H100 PCIe"),
        ("NVIDIA H100 NVL", "fp16", 835.5, "H100 NVL"),
        ("NVIDIA H200", "bf16", 989.5, "H200 SXM"),
        ("NVIDIA H200 NVL", "tf32", 417.5, "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5, "A100"),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156, "A100"),
        ("NVIDIA A10", "bf16", 125, "A10"),
        ("NVIDIA L4", "bf16", 121, "L4"),
        ("NVIDIA L40S", "bf16", 362.05, "L40S"),
        ("Tesla V100-SXM2-16GB", "fp16", 125, "V100"),
        ("Tesla T4", "fp32", 8.1, "T4"),
    ],
)
def test_table_matches_device_names(name: str, precision: str, tflops: float, label: str) -> None:
    assert table_peak(name, precision) == PeakFlops(tflops * 1e12, f"table: {label} {precision}")


def test_unknown_gpu_has_no_table_entry() -> None:
    assert table_peak("Some Future GPU", "bf16") is None


def test_precision_names() -> None:
    assert precision_name(torch.bfloat16) == "bf16" and precision_name(torch.float16) == "fp16"
    assert precision_name(torch.float32) == "fp32" and precision_name(torch.float32, tf32=True) == "tf32"
    with pytest.raises(ValueError, match="float64"):
        precision_name(torch.float64)


def test_cpu_peak_is_measured_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_probe() -> PeakFlops:
        calls.append(1)
        return PeakFlops(5e10, "measured: fake")

    monkeypatch.setattr(mfu, "_CACHE", {})
    monkeypatch.setattr(mfu, "measure_cpu_peak", fake_probe)
    first = peak_flops(torch.device("cpu"), torch.float32)
    assert peak_flops(torch.device("cpu"), torch.bfloat16) == first == PeakFlops(5e10, "measured: fake")
    assert calls == [1]


def test_cpu_probe_is_short_and_positive() -> None:
    peak = mfu.measure_cpu_peak(n=256, budget_s=0.05, repeats=3)
    assert peak.flops_per_second > 0
    assert peak.source.startswith("measured: 256x256 fp32 matmul probe (") and "threads" in peak.source
