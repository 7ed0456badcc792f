"""The arrival-order bucket re-layout (zero/arrival_order.py) under a streamed offload optimizer
(zero/relayout_streamed.py): NVMe ``offload_optimizer`` at stages 1 and 2, fp32 and bf16, ``ratio`` < 1, with
per-bucket host gradient copies forced on the CPU (``StreamedAdam.FORCE_HOST_GRADS``).

The model is a stack of Linear layers that forward runs in the opposite order to their registration, so the
initial (reverse registration) layout is wrong and the first backward must re-lay the buckets out. Checked: the
offloaded run's layout is the one the same run without offload gets (arrival order), the optimizer's chunks and
host gradient buffers follow the new bucket tensors (no late copies), training equals the run without offload, and
runs resumed from checkpoints saved before and after the re-layout continue exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from parity import OFFLOAD_AIO, train_engine

import shardspeed
from shardspeed.offload.optimizer import StreamedAdam

WIDTH, DEPTH = 6, 4
BUCKET = 50  # reduce_bucket_size: one layer (42 elements) per bucket, so bucket order is layer order
MB, GAS = 2, 2


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):  # the opposite of registration order
            x = torch.tanh(layer(x))
        return x


def _batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    return [(x, torch.tanh(x @ teacher)) for x in (torch.randn(rows, WIDTH, generator=g) for _ in range(steps))]


def _engine(stage: int, bf16: bool, nvme: str | None, ratio: float = 1.0) -> Any:
    torch.manual_seed(0)
    model = Stack()
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": BUCKET, "sub_group_size": 17}  # chunks
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "ratio": ratio}
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "gradient_clipping": 0.05,  # every step clips: host copies are scaled
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "aio": OFFLOAD_AIO,
        "steps_per_print": 1000,
    }
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, *_ = shardspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def _params(engine: Any) -> dict[str, torch.Tensor]:
    full = engine.module_state_dict()
    return {n: full[n].float().clone() for n, _ in engine.module.named_parameters()}


def _follows(engine: Any) -> bool:
    """The streamed optimizer steps exactly the stage's (new) bucket tensors, and its host buffers are theirs."""
    opt = engine.optimizer
    chunked = {id(c.tensor) for chunks in opt.group_chunks for c in chunks}
    offloaded = {id(c.tensor) for chunks in opt.group_chunks for c in chunks if c.offloaded}
    hosted = set(opt.host_grads._host) if opt.host_grads is not None else offloaded
    return chunked == {id(t) for t in engine.states.bucket_tensors} and hosted == offloaded


def _parity(rank: int, world: int, stage: int, bf16: bool, ratio: float, tmp: str) -> dict:
    StreamedAdam.FORCE_HOST_GRADS = True  # this forked rank only
    data = _batches(3, MB * GAS * world)
    out: dict[str, Any] = {}
    for label, nvme in (("plain", None), ("offloaded", os.path.join(tmp, "nvme"))):
        engine = _engine(stage, bf16, nvme, ratio)
        initial = engine.states.layout.placement
        train_engine(engine, rank, world, data, MB, GAS)
        out[label] = {"placement": engine.states.layout.placement, "initial": initial, "params": _params(engine)}
        if nvme is not None:
            out["follows"] = _follows(engine)
            out["host_copies"] = engine.optimizer.host_grads.last_step  # (staged, late) of the last step
            out["tensors"] = len(engine.states.bucket_tensors)
        engine.destroy()
    return out


@pytest.mark.parametrize(("stage", "bf16", "ratio"), [(1, False, 1.0), (2, False, 0.5), (2, True, 1.0)])
def test_offloaded_run_relays_out_and_matches_plain(dist_run, tmp_path: Path, stage: int, bf16: bool, ratio: float):
    for r in dist_run(_parity, 2, stage, bf16, ratio, str(tmp_path)):
        plain, offloaded = r["plain"], r["offloaded"]
        assert offloaded["placement"] != offloaded["initial"]  # re-laid out …
        assert offloaded["placement"] == plain["placement"]  # … in arrival order, as without offload
        assert r["follows"]
        staged = r["tensors"] if ratio == 1.0 else None
        assert r["host_copies"][1] == 0 and (staged is None or r["host_copies"][0] == staged), r["host_copies"]
        tol = 1e-6 if not bf16 else 0.0
        worst = max((offloaded["params"][n] - p).abs().max().item() for n, p in plain["params"].items())
        print(f"stage {stage} bf16={bf16} ratio={ratio}: max |offloaded - plain| = {worst}")
        for name, p in plain["params"].items():
            assert (offloaded["params"][name] - p).abs().max().item() <= tol, name


def _resume(rank: int, world: int, stage: int, bf16: bool, ratio: float, tmp: str) -> dict:
    data = _batches(4, MB * GAS * world)
    nvme, ckpt = os.path.join(tmp, "nvme"), os.path.join(tmp, "ckpt")
    first = _engine(stage, bf16, nvme, ratio)
    first.save_checkpoint(ckpt, tag="before")  # before the first backward: initial layout
    train_engine(first, rank, world, data[:2], MB, GAS)
    first.save_checkpoint(ckpt, tag="after")  # re-laid out, two steps of Adam state
    train_engine(first, rank, world, data[2:], MB, GAS)
    out: dict[str, Any] = {"reference": _params(first)}
    first.destroy()
    for tag, start in (("before", 0), ("after", 2)):
        resumed = _engine(stage, bf16, nvme, ratio)
        initial = resumed.states.layout.placement
        resumed.load_checkpoint(ckpt, tag=tag)  # states exist before this engine's re-layout: they are carried
        train_engine(resumed, rank, world, data[start:], MB, GAS)
        out[tag] = {"params": _params(resumed), "relaid": resumed.states.layout.placement != initial}
        out[tag]["follows"] = _follows(resumed)
        resumed.destroy()
    return out


@pytest.mark.parametrize(("stage", "bf16", "ratio"), [(1, False, 1.0), (2, True, 0.5)])
def test_resume_across_the_relayout_continues_exactly(dist_run, tmp_path: Path, stage: int, bf16: bool, ratio: float):
    for r in dist_run(_resume, 2, stage, bf16, ratio, str(tmp_path)):
        for tag in ("before", "after"):
            assert r[tag]["relaid"] and r[tag]["follows"], tag
            for name, value in r["reference"].items():
                assert torch.equal(r[tag]["params"][name], value), (tag, name)
