"""``OneBitAdam`` against DeepSpeed 0.19.6's own ``OnebitAdam`` through warm-up *and* the compressed phase, on the
same gloo ranks: DeepSpeed's optimizer and its ``CompressedBackend`` run from their source
(tests/dist/deepspeed_onebit_source.py), ours bound to ``Collectives`` directly. Both get the same gradients: the
mean of the ranks' gradients during warm-up (what an engine's all-reduce gives them), each rank's own once
compression owns communication. Parameters agree bit for bit at every step, with weight decay, several parameter
groups and an ``exp_avg_mask``: the compressed phase is DeepSpeed's algorithm, each parameter compressed apart
([Note: per-parameter compression] in compression/onebit_adam.py), not merely its warm-up."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed_onebit_source import ONEBIT_ADAM, onebit_adam_class
from onebit_workers import shardspeed_messages

from harness import run_ranks
from shardspeed.comm import Collectives, CommsLog
from shardspeed.compression.onebit_adam import OneBitAdam
from shardspeed.topology import AxisGroup

pytestmark = pytest.mark.skipif(not ONEBIT_ADAM.is_file(), reason=f"DeepSpeed 0.19.6 source not found at {ONEBIT_ADAM}")

STEPS, FREEZE = 9, 4
SHAPES = ((6, 5), (9,), (3, 4), (1,), (40,))  # a 1-element tensor and sizes that need padding at N = 2 and 4
HYPER = {"lr": 0.02, "freeze_step": FREEZE, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    mask = torch.ones(6, 5)
    mask[4:] = 0.0  # DeepSpeed's exp_avg_mask: momentum rows zeroed after every compressed mean
    return [{"params": params[:1], "exp_avg_mask": mask}, {"params": params[1:3]}, {"params": params[3:]}]


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _run(rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(shape, generator=gen) for shape in SHAPES]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    namespace = types.SimpleNamespace(mpu=None, local_rank=0)
    ds = onebit_adam_class()(_groups(theirs), deepspeed=namespace, comm_backend_name="compressed", **HYPER)
    opt = OneBitAdam(_groups(ours), **HYPER)
    opt.bind(Collectives(CommsLog(enabled=False)), AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank))
    worst, phases = 0.0, []
    for step in range(1, STEPS + 1):
        compressed = opt.owns_communication
        assert compressed == ds.adam_freeze_key, f"step {step}: the phases differ"
        if compressed:
            grads = _grads(step, rank)
        else:
            per_rank = [_grads(step, r) for r in range(world)]
            grads = [torch.stack([g[i] for g in per_rank]).mean(0) for i in range(len(SHAPES))]
        for a, b, g in zip(theirs, ours, grads):
            a.grad, b.grad = g.clone(), g.clone()
        ds.step()
        opt.step()
        phases.append(compressed)
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(theirs, ours)))
    moved = max((b - s).abs().max().item() for b, s in zip(ours, start))
    return {"worst": worst, "phases": phases, "moved": moved}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_onebit_adam_equals_deepspeed_through_the_compressed_phase(tmp_path: Any, world: int) -> None:
    for result in run_ranks(_run, world, tmp_path):
        assert result["phases"] == [False] * FREEZE + [True] * (STEPS - FREEZE), result["phases"]
        assert result["worst"] == 0.0, result
        assert result["moved"] > 0.05  # the steps did something


def _old_layout(rank: int, world: int) -> dict[str, Any]:
    """Error buffers saved under keys this run's compressors do not use (an older release's one buffer per param
    group) are dropped with a warning at the first compressed step; the parameters' own buffers are kept."""
    with shardspeed_messages() as records:
        params = [torch.nn.Parameter(torch.ones(shape)) for shape in SHAPES]
        opt = OneBitAdam(params, lr=0.01, freeze_step=2)
        opt.bind(Collectives(CommsLog(enabled=False)), AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank))
        stale = {"group0/meta": torch.tensor([10, world]), "group0/worker_error": torch.ones(16)}
        opt.load_compression_state_dict(stale, same_world=True)
        for step in range(3):
            for p in params:
                p.grad = torch.full_like(p, float(step + rank))
            opt.step()
        keys = sorted(opt.compression_state_dict())
    return {"keys": keys, "warnings": [r for r in records if "match no compressor" in r]}


def test_error_buffers_of_another_layout_are_dropped_with_a_warning(tmp_path: Any) -> None:
    for result in run_ranks(_old_layout, 2, tmp_path):
        assert len(result["warnings"]) == 1 and "group0" in result["warnings"][0], result
        assert not any(k.startswith("group0/") for k in result["keys"]), result["keys"]
        assert {k.split("/")[0] for k in result["keys"]} == {"group0.params"}
