"""Model FLOPs utilization: achieved model FLOPs / the devices' peak.

The peak comes from a table of vendor datasheet figures for known GPUs (dense, i.e. without 2:4 sparsity), keyed by
``torch.cuda.get_device_name``; for a CPU (or an unknown GPU) it is measured once per process by a short fp32
matmul probe. [Note: the CPU probe] The probe runs on this process's torch threads (``torch.get_num_threads()``),
so it measures what *this rank* can do, not the socket: with several ranks per host each probe sees its own
threads, and MFU is then relative to what the rank was given. Best of a few repeats within ~0.3 s.
"""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import torch

__all__ = ["PeakFlops", "model_flops_utilization", "peak_flops", "table_peak"]


class PeakFlops(NamedTuple):
    flops_per_second: float
    source: str
    """"table: H100 SXM bf16" or "measured: 1024x1024 fp32 matmul probe (2 threads, best of 5)"."""


T = 1e12
# Dense peak TFLOPS per GPU by precision: (fp32, tf32, bf16, fp16). Datasheet figures halved where the sheet
# quotes them "with sparsity". Sources (NVIDIA datasheets):
#   A100: "NVIDIA A100 Tensor Core GPU" datasheet (2021): FP32 19.5, TF32 156, BF16/FP16 312.
#   H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (2023): SXM FP32 67, TF32 494.5, BF16/FP16
#     989.5; PCIe FP32 51, TF32 378, BF16/FP16 756; NVL FP32 60, TF32 417.5, BF16/FP16 835.5.
#   H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet (2024): SXM as H100 SXM; NVL FP32 60, TF32 417.5,
#     BF16/FP16 835.5.
#   L4: "NVIDIA L4 Tensor Core GPU" datasheet (2023): FP32 30.3, TF32 60, BF16/FP16 121.
#   L40S: "NVIDIA L40S" datasheet (2023): FP32 91.6, TF32 183, BF16/FP16 362.05.
#   A10: "NVIDIA A10 Tensor Core GPU" datasheet (2021): FP32 31.2, TF32 62.5, BF16/FP16 125.
#   V100 SXM2: "NVIDIA Tesla V100" datasheet (2020): FP32 15.7, FP16 (tensor) 125; no TF32/BF16 (fp32 rate).
#   T4: "NVIDIA T4" datasheet (2019): FP32 8.1, FP16 (tensor) 65; no TF32/BF16 (fp32 rate).
# Ordered: the first pattern matching the device name wins (so "H100 NVL" before "H100", "A100" before "A10").
_TABLE: tuple[tuple[str, str, tuple[float, float, float, float]], ...] = (
    (r"H200.*NVL", "H200 NVL", (60, 417.5, 835.5, 835.5)),
    (r"H200", "H200 SXM", (67, 494.5, 989.5, 989.5)),
    (r"H100.*NVL", "H100 NVL", (60, 417.5, 835.5, 835.5)),
    (r"H100.*PCIe", "H100 PCIe", (51, 378, 756, 756)),
    (r"H100", "H100 SXM", (67, 494.5, 989.5, 989.5)),
    (r"A100", "A100", (19.5, 156, 312, 312)),
    (r"L40S", "L40S", (91.6, 183, 362.05, 362.05)),
    (r"\bL4\b", "L4", (30.3, 60, 121, 121)),
    (r"\bA10\b", "A10", (31.2, 62.5, 125, 125)),
    (r"V100", "V100", (15.7, 15.7, 15.7, 125)),
    (r"\bT4\b", "T4", (8.1, 8.1, 8.1, 65)),
)
_COLUMN = {"fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3}
_CACHE: dict[tuple[str, str], PeakFlops] = {}


def precision_name(dtype: torch.dtype, tf32: bool = False) -> str:
    """The table's column for a compute dtype (fp32 matmuls on TF32 tensor cores when ``tf32``)."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        return "tf32" if tf32 else "fp32"
    raise ValueError(f"no peak FLOPS figure for dtype {dtype} (bf16, fp16 or fp32)")


def table_peak(device_name: str, precision: str) -> PeakFlops | None:
    """The datasheet peak of a GPU named ``device_name`` at ``precision`` (fp32/tf32/bf16/fp16); None if unknown."""
    for pattern, label, figures in _TABLE:
        if re.search(pattern, device_name):
            return PeakFlops(figures[_COLUMN[precision]] * T, f"table: {label} {precision}")
    return None


def measure_cpu_peak(n: int = 1024, budget_s: float = 0.3, repeats: int = 5) -> PeakFlops:
    """Best fp32 ``n×n @ n×n`` rate over up to ``repeats`` timed runs within ``budget_s`` ([Note: the CPU probe])."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator)
    b = torch.randn(n, n, generator=generator)
    torch.mm(a, b)  # warm-up: first-call allocation and kernel selection
    best, runs, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while runs < repeats and (runs == 0 or time.perf_counter() < deadline):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        runs += 1
    threads = torch.get_num_threads()
    return PeakFlops(2 * n**3 / best, f"measured: {n}x{n} fp32 matmul probe ({threads} threads, best of {runs})")


def peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """Peak FLOPS of one ``device`` for ``dtype`` compute: the table for known GPUs, else a measured probe (cached
    per process)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        key = (name, precision_name(dtype, tf32))
        if key not in _CACHE:
            found = table_peak(*key)
            _CACHE[key] = found if found is not None else _measure_cuda(device, dtype, name)
        return _CACHE[key]
    key = ("cpu", "fp32")  # the probe is fp32 whatever the dtype: CPUs have no faster dense matmul to quote
    if key not in _CACHE:
        _CACHE[key] = measure_cpu_peak()
    return _CACHE[key]


def _measure_cuda(device: torch.device, dtype: torch.dtype, name: str, n: int = 4096) -> PeakFlops:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return PeakFlops(2 * n**3 / best, f"measured: {n}x{n} {str(dtype).removeprefix('torch.')} matmul probe on {name}")


def model_flops_utilization(
    model_flops_per_sample: float, samples_per_second: float, devices: int, peak: float
) -> float:
    """Achieved model FLOPs over the devices' peak: ``flops/sample × samples/s / (devices × peak)``, a fraction."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if peak <= 0:
        raise ValueError(f"peak FLOPS must be positive, got {peak}")
    if model_flops_per_sample < 0 or samples_per_second < 0:
        raise ValueError(
            f"model_flops_per_sample ({model_flops_per_sample}) and samples_per_second ({samples_per_second}) "
            "must be non-negative"
        )
    return model_flops_per_sample * samples_per_second / (devices * peak)
