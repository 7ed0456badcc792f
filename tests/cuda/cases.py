"""Training runs the CUDA tests compare, written for any device: the engine picks it (``cuda:LOCAL_RANK`` when CUDA is
visible), the run moves each batch there and returns plain values and CPU tensors, so the same function serves a
world of one, gloo ranks sharing a GPU and NCCL ranks (and runs on CPU when checking the test code itself).

The model, batches and plain-torch reference are the CPU parity tests' (tests/dist/parity.py): rank r, micro-step m
sees rows [(m·N + r)·mb, …) of the global batch; the reference trains fp32 torch on the CPU on the whole batch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from parity import OFFLOAD_AIO, global_batches, make_model, optimizer_config, rank_slice

import shardspeed

STEPS, MB, GAS, LR, CLIP = 5, 2, 2, 0.05, 0.5
FP32_ATOL = 1e-5  # the CPU parity tests' tolerance: CUDA's fp32 kernels only reorder sums (TF32 is off by default)
# bf16 against the fp32 reference: with SGD (momentum) the difference follows the gradients' bf16 error, and the
# parameters themselves are bf16: rounding alone is up to half a bf16 ulp, 2e-3 near the largest weights (|w| ≈ 0.5;
# measured on CPU: 1.5e-3 after 5 steps that moved weights by 0.1). 6e-3 is 1.5 ulps there. Adam is not compared in
# bf16: it normalizes each element's step, so a gradient near zero whose sign bf16 flips moves that weight by up
# to 2·lr either way (measured: 5e-2), which says nothing about the engine.
BF16_ATOL = 6e-3


def engine_config(
    stage: int,
    *,
    dtype: str = "fp32",
    kind: str = "adamw",
    zero_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer_config(kind, LR),
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 100,  # several buckets on the tiny model
            "stage3_param_persistence_threshold": 0,
            **(zero_extra or {}),
        },
        "aio": OFFLOAD_AIO,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True}
    config.update(extra or {})
    return config


def train(rank: int, world: int, config: dict[str, Any], steps: int = STEPS, model: Any = None) -> dict[str, Any]:
    """Train the parity model under ``config``; what the tests compare, on the CPU."""
    model = model if model is not None else make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = engine.device
    dtype = next(iter(engine.module.parameters())).dtype
    losses, norms = [], []
    for x, y in global_batches(steps, MB * GAS * world):
        for m in range(GAS):
            xs = rank_slice(x, m, rank, world, MB).to(device=device, dtype=dtype)
            ys = rank_slice(y, m, rank, world, MB).to(device)
            loss = F.mse_loss(engine(xs).float(), ys)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    full = engine.module_state_dict()
    result = {
        "device": str(device),
        "param_devices": sorted({str(p.device) for p in engine.module.parameters()}),
        "params": {n: full[n].detach().float().cpu() for n, _ in engine.module.named_parameters()},
        "losses": losses,
        "norms": norms,
        "skipped_steps": engine.progress.skipped_steps,
        "loss_scale": engine.get_loss_scale(),
        "finite": all(bool(torch.isfinite(t).all()) for t in full.values()),
    }
    host_grads = getattr(engine.optimizer, "host_grads", None)
    if host_grads is not None:  # offload: the side-stream copies of the last step (staged, copied late)
        result["host_grads"] = {
            "last_step": host_grads.last_step,
            "pinned": all(t.is_pinned() for t in host_grads._host.values()),
            "stream": host_grads._stream is not None,
        }
    engine.destroy()
    return result


def offload_sections(tmp: str, optimizer: str | None, param: str | None, pin: bool = True) -> dict[str, Any]:
    """``offload_optimizer`` / ``offload_param`` sections (``cpu`` or ``nvme``), pinned."""
    zero: dict[str, Any] = {}
    if optimizer is not None:
        zero["offload_optimizer"] = {"device": optimizer, "pin_memory": pin}
        if optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = os.path.join(tmp, "opt")
    if param is not None:
        zero["offload_param"] = {"device": param, "pin_memory": pin}
        if param == "nvme":
            zero["offload_param"].update(nvme_path=os.path.join(tmp, "param"), max_in_cpu=0)
    return zero


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return {name: (a[name].float() - b[name].float()).abs().max().item() for name in a}
