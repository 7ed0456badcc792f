"""Offload on CUDA, pinned memory and side streams: ``offload_optimizer`` (cpu, nvme) at stages 1-3 and
``offload_param`` (cpu, nvme) at stage 3 equal the same stage without offload on the same GPU.

What only a GPU exercises: HostGradients' copies of each reduced bucket into pinned host memory on a side stream
(``non_blocking`` + ``record_stream`` + an event the step waits on), the optimizer's updated values copied back to
the device, offloaded ZeRO-3 shards read into pinned pool buffers and copied up non-blocking before the gather.
A missing synchronization shows as parameters that differ from the run without offload (or NaN), not as an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cases import FP32_ATOL, engine_config, max_diff, offload_sections, train
from cuda_support import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_optimizer_offload_on_cuda_equals_no_offload(tmp_path: Path, stage: int, device: str) -> None:
    plain = train(0, 1, engine_config(stage))
    offloaded = train(0, 1, engine_config(stage, zero_extra=offload_sections(str(tmp_path), device, None)))
    assert offloaded["device"] == "cuda:0" and offloaded["finite"]
    diffs = max_diff(offloaded["params"], plain["params"])
    assert max(diffs.values()) <= FP32_ATOL, diffs  # the CPU Adam vs torch's on the GPU: same math, other kernels
    grads = offloaded["host_grads"]  # the device gradients crossed per bucket on a side stream into pinned memory
    assert grads["stream"] and grads["pinned"]
    staged, late = grads["last_step"]
    assert staged > 0 and late == 0  # every offloaded tensor copied as its bucket completed, none when the step asked


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("with_optimizer_offload", [False, True])
def test_param_offload_on_cuda_equals_no_offload(tmp_path: Path, device: str, with_optimizer_offload: bool) -> None:
    """offload_param needs bf16 or fp16 (its host copy is the 16-bit shard)."""
    plain = train(0, 1, engine_config(3, dtype="bf16"))
    optimizer = "nvme" if with_optimizer_offload else None
    zero = offload_sections(str(tmp_path), optimizer, device)
    offloaded = train(0, 1, engine_config(3, dtype="bf16", zero_extra=zero))
    assert offloaded["device"] == "cuda:0" and offloaded["finite"]
    diffs = max_diff(offloaded["params"], plain["params"])
    # The same bf16 math on the GPU: equal. With the optimizer offloaded too, the CPU Adam steps the fp32 masters
    # instead of torch's CUDA AdamW: masters within 1e-5, so a weight may round to the next bf16 value (2^-8 ≈ 4e-3
    # relative; the weights are below 1).
    assert max(diffs.values()) <= (8e-3 if with_optimizer_offload else 1e-6), diffs
