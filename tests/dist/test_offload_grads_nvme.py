"""ZeRO-Infinity's gradients on NVMe, world 2 ([Note: gradients on NVMe] in zero/stage3/grad_offload.py): ZeRO-3
with ``offload_param`` and ``offload_optimizer`` on NVMe trains bit-for-bit like the same run whose gradient shards
stay in host memory (``offload_gradients: false``) — GAS 1 and 2, clipping on, fp32 and bf16 — with the same grad
norm every step, while the gradient bytes resident after backward drop from 4Ψ/N to nothing; an ENOSPC while a
gradient is written behind (during backward) is one agreed ``SwapIOError`` on every rank at the step."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, global_batches, offload_engine, rank_slice

from harness import error_of
from shardspeed.faults.inject import ENV_VAR
from shardspeed.zero.stage3.runtime import REDUCE_SCATTERS_IN_FLIGHT

STEPS, MB = 3, 2


def _engine(tmp: str, on_nvme: bool, gas: int, bf16: bool) -> Any:
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": os.path.join(tmp, "params"), "max_in_cpu": 0},
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": os.path.join(tmp, "opt"),
            "offload_gradients": on_nvme,
        },
    }
    return offload_engine(zero, bf16=bf16, clip=0.5, gas=gas, mb=MB)


def _train(engine: Any, rank: int, world: int, batches: list, gas: int) -> dict[str, Any]:
    dtype = next(iter(engine.module.parameters())).dtype
    losses, norms, resident = [], [], []
    for x, y in batches:
        for m in range(gas):
            out = engine(rank_slice(x, m, rank, world, MB).to(dtype)).float()
            loss = F.mse_loss(out, rank_slice(y, m, rank, world, MB))
            engine.backward(loss)
            resident.append(engine.memory_breakdown()["grad_shard"])  # after each backward, before the step
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "resident": resident}


def _parity(rank: int, world: int, tmp: str, gas: int, bf16: bool) -> dict[str, Any]:
    batches = global_batches(STEPS, MB * gas * world)
    out: dict[str, Any] = {}
    for on_nvme in (False, True):
        engine = _engine(os.path.join(tmp, str(on_nvme)), on_nvme, gas, bf16)
        if on_nvme:  # the smallest write-behind window: every unit's write waits for the previous one's
            engine.optimizer.grad_swap.window_bytes = 1
        run = _train(engine, rank, world, batches, gas)
        run["params"] = full_params(engine)
        run["sink"] = engine.states.grad_sink is not None
        run["padded_shards"] = sum(
            u.shard_numel for u, g in zip(engine.states.units, engine.states.grads) if g.trainable
        )
        run["peak"] = engine.states.grad_sink.peak_bytes if engine.states.grad_sink is not None else None
        run["largest"] = max(u.shard_numel for u in engine.states.units)
        run["stepped"] = sum(t.numel() for ts in engine.states.group_tensors.values() for t in ts)
        run["written"] = engine.optimizer.grad_swap.bytes_written if engine.optimizer.grad_swap is not None else 0
        engine.destroy()
        out[on_nvme] = run
    return out


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gradients_on_nvme_equal_gradients_in_memory(dist_run, tmp_path: Path, gas: int, bf16: bool) -> None:
    for r in dist_run(_parity, 2, str(tmp_path), gas, bf16):
        ram, nvme = r[False], r[True]
        assert not ram["sink"] and nvme["sink"]
        assert ram["losses"] == nvme["losses"]
        assert ram["norms"] == nvme["norms"] and all(n is not None and n > 0 for n in nvme["norms"])
        for name, value in ram["params"].items():
            assert torch.equal(value, nvme["params"][name]), name
        # resident gradient bytes after a backward: 4Ψ/N (every trainable unit's fp32 shard) vs none at all
        assert ram["resident"] == [4 * ram["padded_shards"]] * (STEPS * gas)
        assert nvme["resident"] == [0] * (STEPS * gas)
        # in memory at once: the units being reduced (REDUCE_SCATTERS_IN_FLIGHT + the newest) and one write behind
        assert 0 < nvme["peak"] <= (REDUCE_SCATTERS_IN_FLIGHT + 2) * 4 * nvme["largest"]
        assert nvme["written"] == STEPS * gas * 4 * nvme["stepped"]  # every stepped element, every micro-step


def _write_fails(rank: int, world: int, tmp: str) -> dict[str, Any]:
    gas = 2
    batches = global_batches(2, MB * gas * world)
    engine = _engine(tmp, True, gas, False)
    _train(engine, rank, world, batches[:1], gas)
    x, y = batches[1]
    # rank 1's first swap write from here is the first unit's gradient written behind in this backward
    os.environ[ENV_VAR] = "offload_write:enospc:rank=1"
    start = time.monotonic()
    out = engine(rank_slice(x, 0, rank, world, MB))
    engine.backward(F.mse_loss(out, rank_slice(y, 0, rank, world, MB)))  # deferred: backward itself succeeds
    os.environ.pop(ENV_VAR)
    engine.step()  # not a boundary (GAS 2)
    out = engine(rank_slice(x, 1, rank, world, MB))
    engine.backward(F.mse_loss(out, rank_slice(y, 1, rank, world, MB)))
    error = error_of(engine.step)
    elapsed = time.monotonic() - start
    engine.destroy()
    return {"error": error, "elapsed": elapsed}


def test_enospc_writing_a_gradient_behind_fails_every_rank(dist_run, tmp_path: Path) -> None:
    for r in dist_run(_write_fails, 2, str(tmp_path)):
        assert r["error"].startswith(
            "SwapIOError: [Errno 28] offload_optimizer step 2 failed on data-parallel rank 1: OSError: [Errno 28] "
            "No space left on device (injected by SHARDSPEED_INJECT='offload_write:enospc:rank=1') (writing "
        ), r["error"]
        assert "/grad' at byte " in r["error"] and "-rank1/swap.bin, unlinked at creation)" in r["error"], r["error"]
        assert r["elapsed"] < 30.0


def _clearing(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Per step: a throw-away backward, a clearing (``module.zero_grad()``: one parameter at a time, each read back,
    zeroed and rewritten; ``engine.zero_grad()``: every unit forgotten), two backward passes and a step; on step 2
    rank 1's input holds a NaN, and the non-finite names are read back from the swap file."""
    out: dict[str, Any] = {}
    for on_nvme in (False, True):
        for clear in ("module", "engine"):
            engine = _engine(os.path.join(tmp, f"{on_nvme}-{clear}"), on_nvme, 1, False)
            names = []
            for step, (x, y) in enumerate(global_batches(3, MB * world)):
                xs, ys = rank_slice(x, 0, rank, world, MB).clone(), rank_slice(y, 0, rank, world, MB)
                engine(xs * 3).square().mean().backward()
                (engine.module.mid if clear == "module" else engine).zero_grad()
                if step == 1 and rank == 1:
                    xs[1, 3] = float("nan")
                for half in (slice(0, MB // 2), slice(MB // 2, MB)):
                    engine.backward(F.mse_loss(engine(xs[half]), ys[half]) / 2)
                if step == 1:
                    names = engine.states.nonfinite_grad_names()
                engine.step()
            out[(on_nvme, clear)] = {"params": full_params(engine), "names": names, "skipped": engine.skipped_steps}
            engine.destroy()
    return out


def test_cleared_and_non_finite_gradients_on_nvme_as_in_memory(dist_run, tmp_path: Path) -> None:
    for r in dist_run(_clearing, 2, str(tmp_path)):
        for clear in ("module", "engine"):
            ram, nvme = r[(False, clear)], r[(True, clear)]
            assert ram["skipped"] == nvme["skipped"] == 1
            assert ram["names"] == nvme["names"] and "inp.weight" in nvme["names"]
            for name, value in ram["params"].items():
                assert torch.isfinite(value).all() and torch.equal(value, nvme["params"][name]), (clear, name)
