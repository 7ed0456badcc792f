"""Offload's per-bucket host gradient copies (``HostGradients``): on an accelerator each bucket's (ZeRO-1/2) or
unit's (ZeRO-3) final reduced gradient starts its copy to the host as soon as it is in place, during backward.
This machine has no accelerator, so the tests force the copies on the CPU (``StreamedAdam.FORCE_HOST_GRADS``) and
check the bookkeeping: every offloaded tensor staged once per step and none copied late, copies issued before
backward ends, clipping applied to the copies, and training equal to the same stage without offload.

At ZeRO-3 with NVMe the reduced gradients go to the swap file by default (stage3/grad_offload.py), not through host
copies: the host-copy cases there switch ``offload_gradients`` off, and ``nvme_grads`` checks the swap file's own
accounting instead (every stepped tensor's gradient written each step, none host-copied, same training)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.nn.functional as F
from parity import full_params, global_batches, offload_engine, rank_slice

from shardspeed.offload.optimizer import StreamedAdam

MB, GAS, STEPS = 2, 2, 4


def _engine(stage: int, tmp: str | None, *, bf16: bool, overlap: bool, nvme_grads: bool = False):
    zero: dict = {"stage": stage, "reduce_bucket_size": 100, "overlap_comm": overlap}  # several buckets
    if tmp is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "opt")}
        if stage == 3 and not nvme_grads:  # ZeRO-3's default sends gradients to the swap file, not host copies
            zero["offload_optimizer"]["offload_gradients"] = False
    # clip small enough that every step clips: the host copies must be scaled
    return offload_engine(zero, bf16=bf16, clip=0.05, mb=MB, gas=GAS)


def _run(rank: int, world: int, stage: int, tmp: str, bf16: bool, overlap: bool, nvme_grads: bool) -> dict:
    StreamedAdam.FORCE_HOST_GRADS = True  # this forked rank only
    batches = global_batches(STEPS, MB * GAS * world)
    out: dict = {"during_backward": [], "per_step": [], "norms": []}
    engines = {
        "plain": _engine(stage, None, bf16=bf16, overlap=overlap),
        "offloaded": _engine(stage, tmp, bf16=bf16, overlap=overlap, nvme_grads=nvme_grads),
    }
    offloaded = engines["offloaded"]
    host_grads, swap = offloaded.optimizer.host_grads, offloaded.optimizer.grad_swap
    out["host_grads"], out["swap"] = host_grads is not None, swap is not None
    reducer = offloaded.states.reducer
    if host_grads is not None:
        stage_grads = offloaded.optimizer.stage_grads

        def recording_stage(tensors: list) -> None:
            out["during_backward"].append(reducer._in_backward)
            stage_grads(tensors)

        offloaded.states.set_final_grads_hook(recording_stage)
    io = (0, 0)  # the swap file's bytes written, read before the previous step
    for label, engine in engines.items():
        dtype = next(iter(engine.module.parameters())).dtype
        for x, y in batches:
            for m in range(GAS):
                loss = F.mse_loss(
                    engine(rank_slice(x, m, rank, world, MB).to(dtype)).float(), rank_slice(y, m, rank, world, MB)
                )
                engine.backward(loss)
                if swap is not None and engine is offloaded and m == GAS - 1:
                    out["per_step"].append((len(swap.written), swap.bytes_written - io[0], swap.bytes_read - io[1]))
                    io = (swap.bytes_written, swap.bytes_read)
                engine.step()
            if label == "offloaded" and host_grads is not None:
                out["per_step"].append(host_grads.last_step)
                out["norms"].append(engine.get_global_grad_norm())
        out[label] = full_params(engine)
    out["tensors"] = len({id(c.tensor) for chunks in offloaded.optimizer.group_chunks for c in chunks})
    out["chunks"] = sum(len(chunks) for chunks in offloaded.optimizer.group_chunks)
    # stages 1/2: the layout was planned from the first backward's arrival order despite the host copies
    out["planned"] = getattr(reducer, "_planned", None)
    for engine in engines.values():
        engine.destroy()
    return out


@pytest.mark.parametrize(("stage", "bf16", "overlap", "nvme_grads"),
                         [(1, False, False, False), (2, False, False, False), (3, False, False, False),
                          (2, True, True, False), (3, True, True, False), (3, False, False, True)])  # fmt: skip
def test_host_gradient_copies_per_bucket(
    dist_run, tmp_path: Path, stage: int, bf16: bool, overlap: bool, nvme_grads: bool
) -> None:
    for r in dist_run(_run, 2, stage, str(tmp_path), bf16, overlap, nvme_grads):
        for name, p in r["plain"].items():
            assert (r["offloaded"][name] - p).abs().max().item() <= 1e-6, name
        assert all(norm > 0.05 for norm in r["norms"])  # every step clipped
        assert (r["host_grads"], r["swap"]) == (not nvme_grads, nvme_grads)
        if nvme_grads:  # every chunk's gradient in the swap file before each step. Between two steps' boundaries:
            # each of the GAS micro-steps writes every gradient (nbytes), each after the first reads the previous sum
            # back (accumulated in the file), and the previous step read each once
            nbytes = r["per_step"][0][1] // GAS
            expected = [(r["chunks"], GAS * nbytes, (GAS - 1 + (s > 0)) * nbytes) for s in range(STEPS)]
            assert nbytes > 0 and r["per_step"] == expected, r["per_step"]
            continue
        assert r["per_step"] == [(r["tensors"], 0)] * STEPS  # each tensor staged once per step, none late
        assert stage == 3 or r["planned"]  # re-layout from arrival order ran (tests/dist/test_relayout_offload.py)
        if not overlap:  # each bucket completes as it is reduced: the first copies start inside backward
            assert any(r["during_backward"]), r["during_backward"]
