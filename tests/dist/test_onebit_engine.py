"""ZeroOneAdam and OneBitLamb through the engine at world 2 (GAS 2, config ``optimizer.type``): equal to the
simulated-workers reference of the same algorithm fed the same local gradients, ranks bitwise equal wherever
the algorithm synchronizes them, no gradient all-reduce by the engine while the optimizer owns communication,
and checkpoint resume (error buffers, counters, coefficients) bit for bit at the same world size."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from onebit_workers import load_with_warnings, simulate
from parity import global_batches, make_model, rank_slice
from torch.func import functional_call
from torch.nn.utils import parameters_to_vector

import shardspeed
from shardspeed.compression.onebit_lamb import OneBitLamb
from shardspeed.compression.zero_one_adam import ZeroOneAdam, step_kind

STEPS, MB, GAS, WORLD = 10, 2, 2, 2
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "ZeroOneAdam": (ZeroOneAdam, {"lr": 0.02, "weight_decay": 0.01, "var_freeze_step": 5, "var_update_scaler": 2,
                                  "local_step_scaler": 2, "local_step_clipper": 2}),
    "OneBitLamb": (OneBitLamb, {"lr": 0.02, "freeze_step": 4, "weight_decay": 0.01}),
}  # fmt: skip


def _config(name: str, bf16: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": name, "params": CASES[name][1]},
        "comms_logger": {"enabled": True},
        "steps_per_print": 1000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _flat(engine: Any) -> torch.Tensor:
    return parameters_to_vector([p.detach().float() for p in engine.module.parameters()]).clone()


def _kind(opt: Any) -> str:
    if isinstance(opt, ZeroOneAdam):
        return "init" if opt.schedule().step == 0 else step_kind(opt.schedule(), opt.var_freeze_step)
    return "compressed" if opt.owns_communication else "warmup"


def _run(
    rank: int, world: int, name: str, ckpt: str | None = None, save_at: int = 0, load: bool = False, bf16: bool = False
) -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config(name, bf16))
    dtype = next(engine.module.parameters()).dtype
    batches = global_batches(STEPS, MB * GAS * world)
    start = save_at if load else 0
    if load:
        engine.load_checkpoint(ckpt)
    params, comms, kinds = [], [], []
    for i in range(start, STEPS):
        x, y = batches[i]
        kinds.append(_kind(engine.optimizer))
        engine.comms_log.reset()
        for m in range(GAS):
            out = engine(rank_slice(x, m, rank, world, MB).to(dtype)).float()
            loss = F.mse_loss(out, rank_slice(y, m, rank, world, MB))
            engine.backward(loss)
            engine.step()
        comms.append(set(engine.comms_log.rows()))
        params.append(_flat(engine))
        if ckpt is not None and not load and i + 1 == save_at:
            engine.save_checkpoint(ckpt)
    engine.destroy()
    return {"params": params, "comms": comms, "kinds": kinds}


def _reference(name: str) -> list[list[torch.Tensor]]:
    """The simulated workers, each fed what the engine hands its optimizer (local or mean gradients)."""
    cls, kwargs = CASES[name]
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    batches = global_batches(STEPS, MB * GAS * WORLD)

    lock = threading.Lock()  # functional_call swaps the shared module's tensors: one worker at a time

    def local_grad(live: list[torch.Tensor], step: int, rank: int) -> list[torch.Tensor]:
        with lock:
            return _local_grad(live, step, rank)

    def _local_grad(live: list[torch.Tensor], step: int, rank: int) -> list[torch.Tensor]:
        x, y = batches[step]
        weights = {n: p.detach().clone().requires_grad_(True) for n, p in zip(names, live, strict=True)}
        total = [torch.zeros_like(p) for p in live]
        for m in range(GAS):
            out = functional_call(model, weights, (rank_slice(x, m, rank, WORLD, MB),))
            loss = F.mse_loss(out, rank_slice(y, m, rank, WORLD, MB)) / GAS
            for t, g in zip(total, torch.autograd.grad(loss, list(weights.values())), strict=True):
                t += g
        return total

    def grads(step: int, rank: int, opt: Any) -> list[torch.Tensor]:
        live = opt.param_groups[0]["params"]
        if opt.owns_communication:
            return local_grad(live, step, rank)
        per_rank = [local_grad(live, step, r) for r in range(WORLD)]  # warm-up: every worker's params agree
        return [sum(parts[1:], parts[0].clone()) / WORLD for parts in zip(*per_rank, strict=True)]

    history = simulate(lambda ps: cls(ps, **kwargs), [p.detach() for p in model.parameters()], grads, WORLD, STEPS)
    return [[parameters_to_vector(worker) for worker in step] for step in history]


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitLamb"])
def test_engine_matches_simulated_workers(dist_run, name: str) -> None:
    results = dist_run(_run, WORLD, name)
    reference = _reference(name)
    kinds = results[0]["kinds"]
    for step in range(STEPS):
        for rank, result in enumerate(results):
            torch.testing.assert_close(result["params"][step], reference[step][rank], atol=2e-5, rtol=0,
                                       msg=lambda m, s=step: f"step {s + 1}: {m}")  # fmt: skip
        if kinds[step] != "local":  # 0/1 Adam's local steps differ between ranks by design
            assert torch.equal(results[0]["params"][step], results[1]["params"][step]), f"step {step + 1}"
    grads_reduced = ["all_reduce:grads" in rows for rows in results[0]["comms"]]
    if name == "ZeroOneAdam":
        assert not any(grads_reduced)  # the optimizer owns communication from the first step
        assert {"variance", "compressed", "local", "sync"} <= set(kinds)
    else:
        assert grads_reduced == [k == "warmup" for k in kinds] and "compressed" in kinds
    assert (reference[-1][0] - reference[0][0]).abs().max() > 1e-3  # training moved the parameters


@pytest.mark.parametrize(
    "name,save_at", [("ZeroOneAdam", 7), ("ZeroOneAdam", 9), pytest.param("OneBitLamb", 6, marks=pytest.mark.slow)]
)  # 7: after a sync step; 9: after a local step (ranks differ). OneBitLamb's optimizer-level resume
# (test_onebit_optimizers.py) stays in the default suite
def test_engine_resume_is_bit_exact(dist_run, tmp_path, name: str, save_at: int) -> None:
    full = dist_run(_run, WORLD, name, str(tmp_path), save_at)
    resumed = dist_run(_run, WORLD, name, str(tmp_path), save_at, True)
    for rank in range(WORLD):
        tail = full[rank]["params"][save_at:]
        assert all(torch.equal(a, b) for a, b in zip(tail, resumed[rank]["params"], strict=True)), rank


@pytest.mark.parametrize("name", ["ZeroOneAdam", pytest.param("OneBitLamb", marks=pytest.mark.slow)])
def test_bf16_ranks_agree_wherever_synchronized(dist_run, name: str) -> None:
    r0, r1 = dist_run(_run, WORLD, name, None, 0, False, True)
    for step, kind in enumerate(r0["kinds"]):
        assert torch.isfinite(r0["params"][step]).all()
        if kind != "local":
            assert torch.equal(r0["params"][step], r1["params"][step]), f"step {step + 1} ({kind})"
    assert not torch.equal(r0["params"][-1], r0["params"][2])  # the compressed phase moved them


def _load_only(rank: int, world: int, name: str, ckpt: str) -> tuple[torch.Tensor, list[str]]:
    engine, records = load_with_warnings(_config(name), ckpt)
    out = _flat(engine)
    engine.destroy()
    return out, records


def test_zero_one_adam_between_syncs_at_another_world_restarts_from_the_last_sync(dist_run, tmp_path) -> None:
    """[Note: 0/1 Adam between syncs in checkpoints]: saved after a local step (ranks differ) at world 2, loaded
    at world 1: the parameters are the last synchronized ones (after step 8, a sync), with one warning."""
    full = dist_run(_run, WORLD, "ZeroOneAdam", str(tmp_path), 9)
    assert full[0]["kinds"][7:9] == ["sync", "local"] and not torch.equal(full[0]["params"][8], full[1]["params"][8])
    ((params, records),) = dist_run(_load_only, 1, "ZeroOneAdam", str(tmp_path))
    assert torch.equal(params, full[0]["params"][7])
    assert len([m for m in records if "restarts from the last synchronized parameters" in m]) == 1, records


def test_zero_one_adam_bf16_resume_between_syncs_is_bit_exact(dist_run, tmp_path) -> None:
    """bf16: the optimizer steps fp32 masters; the local-phase rows restore them, and the load pushes them into
    the bf16 model on every rank."""
    full = dist_run(_run, WORLD, "ZeroOneAdam", str(tmp_path), 9, False, True)
    resumed = dist_run(_run, WORLD, "ZeroOneAdam", str(tmp_path), 9, True, True)
    for rank in range(WORLD):
        tail = full[rank]["params"][9:]
        assert all(torch.equal(a, b) for a, b in zip(tail, resumed[rank]["params"], strict=True)), rank
