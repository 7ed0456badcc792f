"""Rank functions of the multi-process CUDA tests (gloo ranks sharing ``cuda:0``, NCCL ranks one per GPU), run by
``cuda_support.run_spawned_ranks``. Each runs several cases in one process group (a spawned group costs seconds)
and returns plain values: differences from the single-process CPU reference, computed on the rank.

The same functions run on CPU with gloo (``tests/cuda/test_spawned_ranks.py``), which checks the test code itself
where there is no GPU.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
from cases import CLIP, FP32_ATOL, GAS, LR, MB, STEPS, engine_config, max_diff, train
from parity import global_batches, reference_run


def _device() -> torch.device:
    import os

    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")


# --- which ops the backend carries with this device's tensors ------------------------------------------------------
def _all_reduce(rank: int, world: int, device: torch.device) -> bool:
    t = torch.full((5,), float(rank + 1), device=device)
    dist.all_reduce(t, async_op=True).wait()
    return bool((t.cpu() == world * (world + 1) / 2).all())


def _broadcast(rank: int, world: int, device: torch.device) -> bool:
    t = torch.full((5,), float(rank + 7), device=device)
    work = dist.broadcast(t, src=0, async_op=True)
    work.get_future().wait()  # the failure board waits through the future
    return bool((t.cpu() == 7.0).all())


def _all_gather_into_tensor(rank: int, world: int, device: torch.device) -> bool:
    mine = torch.full((3,), float(rank), device=device)
    out = torch.empty(3 * world, device=device)
    dist.all_gather_into_tensor(out, mine, async_op=True).wait()
    return out.cpu().tolist() == [float(r) for r in range(world) for _ in range(3)]


def _reduce_scatter_tensor(rank: int, world: int, device: torch.device) -> bool:
    full = torch.arange(2 * world, dtype=torch.float32, device=device)
    out = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(out, full, async_op=True).wait()
    return out.cpu().tolist() == [float(world * (2 * rank + i)) for i in range(2)]


def _batch_isend_irecv(rank: int, world: int, device: torch.device) -> bool:
    peer = (rank + 1) % world
    src = (rank - 1) % world
    send = torch.full((4,), float(rank), device=device)
    recv = torch.empty(4, device=device)
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, src)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return bool((recv.cpu() == float(src)).all())


PROBES = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "batch_isend_irecv": _batch_isend_irecv,
}


def probe_ops(rank: int, world: int, names: list[str]) -> dict[str, str]:
    """``"ok"``, ``"wrong result"`` or the error (type: first line) of each op, in order, on this rank's device.
    An op the backend refuses raises on every rank alike before communicating, so the next probe stays aligned; an
    op that could crash the process (gloo reading a device pointer as host memory) belongs in its own group."""
    device = _device()
    out = {}
    for name in names:
        try:
            out[name] = "ok" if PROBES[name](rank, world, device) else "wrong result"
        except Exception as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            out[name] = f"{type(error).__name__}: {first[:300]}"
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return out


# --- ZeRO parity over the data axis --------------------------------------------------------------------------------
def zero_parity(rank: int, world: int, stages: list[int], kind: str = "adamw") -> dict[int, dict[str, Any]]:
    """Per stage: the engine's device, its largest difference from plain fp32 torch on the CPU over the whole
    global batch, the norms' largest relative difference — or the error this rank raised (the next stage still
    runs: a stage that fails fails alike on every rank)."""
    reference, ref_norms = reference_run(kind, LR, CLIP, global_batches(STEPS, MB * GAS * world))
    out: dict[int, dict[str, Any]] = {}
    for stage in stages:
        try:
            got = train(rank, world, engine_config(stage, kind=kind))
        except Exception as error:
            out[stage] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
            continue
        norms = [abs(a / b - 1) for a, b in zip(got["norms"], ref_norms)]
        out[stage] = {
            "device": got["device"],
            "diff": max(max_diff(got["params"], reference).values()),
            "norm_rel": max(norms),
            "error": "",
        }
    return out


# --- tensor parallelism (the hand-built GPT of the TP parity tests) --------------------------------------------------
def tp_parity(rank: int, world: int, stages: list[int]) -> dict[int, tuple[float, float]]:
    """TP=2 × DP=world/2 on ``tp_gpt.TPGPT``, fp32 AdamW with clipping: (largest difference from the dense CPU
    reference, how far the reference moved) per ZeRO stage."""
    import test_tp_parity as tpp
    from tp_gpt import TPGPT

    import shardspeed
    from shardspeed.tensor_parallel import TensorParallel
    from shardspeed.topology import MeshShape, Topology

    tp, dp, gas = 2, world // 2, 1
    out = {}
    for stage in stages:
        batches = tpp._batches("gpt", dp, gas)
        topology = Topology.build(MeshShape(tensor=tp, data=dp))
        torch.manual_seed(0)
        model = TPGPT(tpp.GPT_CFG, TensorParallel.from_topology(topology))
        engine, *_ = shardspeed.initialize(model=model, mpu=topology, config=tpp._config(stage, "adamw", gas, {}))
        data_rank = engine.topology.data.rank
        for tokens in batches:
            row = data_rank * tpp.MICRO
            chunk = tokens[row : row + tpp.MICRO].to(engine.device)
            engine.backward(engine(chunk[:, :-1], chunk[:, 1:]))
            engine.step()
        got = {n: t.float().cpu() for n, t in tpp._global(engine).items()}
        expected = tpp._reference("gpt", "adamw", batches, gas)
        start = {n: p.detach() for n, p in tpp._dense("gpt").named_parameters()}
        out[stage] = (
            max(max_diff(got, expected).values()),
            max((expected[n] - start[n]).abs().max().item() for n in expected),
        )
        engine.destroy()
    return out


# --- pipeline parallelism (pipe/links.py's per-direction communicators under NCCL) ----------------------------------
def pipe_parity(rank: int, world: int, schedules: list[str]) -> dict[str, dict[str, float]]:
    """PP=2 on the pipeline parity tests' tiny GPT (tied embedding across the stages), fp32 AdamW, per schedule:
    the largest difference of the whole model from the CPU reference and how far the reference moved."""
    import test_pipe_parity as tpp
    from pipe_models import make_batches, rank_iterator, reference_model, reference_train

    out = {}
    for schedule in schedules:
        case = tpp.Case(world=world, schedule=schedule)
        engine = tpp._engine(case)
        dp = engine.topology.data.size
        batches = make_batches(tpp.STEPS, tpp.M, tpp.MB, dp, vocab=tpp.MODEL["vocab"], seq=tpp.MODEL["seq"])
        it = rank_iterator(batches, tpp.M, engine.topology.data.rank, dp)
        losses = [float(engine.train_batch(it)) for _ in range(tpp.STEPS)]
        got = {n: t.float().cpu() for n, t in engine.module_state_dict().items()}
        ref = reference_model(**tpp.MODEL, tied=case.tied, head_bias=case.head_bias)
        start = {n: p.detach().clone() for n, p in ref.named_parameters()}
        optimizer = tpp.torch_optimizer(case.opt, ref.parameters(), tpp.LR[case.opt])
        ref_losses = reference_train(ref, batches, optimizer, micro_batches=tpp.M, clip=tpp.CLIP)
        expected = {n: p.detach() for n, p in ref.named_parameters()}
        out[schedule] = {
            "diff": max((got[n] - expected[n]).abs().max().item() for n in expected),
            "moved": max((expected[n] - start[n]).abs().max().item() for n in expected),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "device": str(engine.device),
        }
        engine.destroy()
    return out


def everything(rank: int, world: int) -> dict[str, Any]:
    """All of the above in one group of 2 (the CPU check of this file: one spawn)."""
    return {
        "probes": probe_ops(rank, world, list(PROBES)),
        "zero": zero_parity(rank, world, [0, 1, 2, 3]),
        "tp": tp_parity(rank, world, [1]),
        "pipe": pipe_parity(rank, world, ["1f1b"]),
    }


__all__ = ["FP32_ATOL", "everything", "pipe_parity", "probe_ops", "tp_parity", "zero_parity"]
