"""OneBitAdam through the engine at world 2 (GAS 2, clipping): equal to a one-process reference of the same
algorithm with simulated workers (compression/reference.py), parameters identical on every rank at every step,
no gradient all-reduce in the compressed phase (comms log) and its traffic the compressed call's; bf16 and fp16;
checkpoint resume with the error buffers (bit for bit), and at another world size the buffers reset."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from onebit_workers import load_with_warnings
from parity import global_batches, make_model, rank_slice
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import shardspeed
from shardspeed.compression.onebit_adam import apply_update_
from shardspeed.compression.reference import compressed_allreduce
from shardspeed.compression.signs import padded_numel
from shardspeed.precision.grad_norm import clip_coefficient

STEPS, MB, GAS, LR, FREEZE, CLIP, WD, WORLD = 7, 2, 2, 0.02, 3, 0.5, 0.01, 2
BETAS, EPS = (0.9, 0.999), 1e-8


def _config(dtype: str = "fp32", freeze: int = FREEZE) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": freeze, "weight_decay": WD}},
        "gradient_clipping": CLIP,
        "comms_logger": {"enabled": True},
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _flat(engine: shardspeed.ShardSpeedEngine) -> torch.Tensor:
    return parameters_to_vector([p.detach().float() for p in engine.module.parameters()]).clone()


def _micro_steps(engine: shardspeed.ShardSpeedEngine, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> None:
    for m in range(GAS):
        xs = rank_slice(x, m, rank, world, MB).to(next(engine.module.parameters()).dtype)
        loss = F.mse_loss(engine(xs).float(), rank_slice(y, m, rank, world, MB))
        engine.backward(loss)
        engine.step()


def _train(rank: int, world: int, dtype: str) -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config(dtype))
    params, comms = [], []
    for x, y in global_batches(STEPS, MB * GAS * world):
        engine.comms_log.reset()
        _micro_steps(engine, x, y, rank, world)
        params.append(_flat(engine))
        rows = engine.comms_log.rows()
        comms.append({k: (r["count"], engine.comms_log.totals[k].algorithmic_bytes) for k, r in rows.items()})
    return {"params": params, "comms": comms, "owns": engine.optimizer.owns_communication}


def _reference(world: int) -> list[torch.Tensor]:
    """The same algorithm with ``world`` simulated workers in one process (fp32)."""
    model = make_model()
    params = list(model.parameters())
    flat = parameters_to_vector(params).detach().clone()
    n = flat.numel()
    m, v = torch.zeros(n), torch.zeros(n)
    sizes = [p.numel() for p in params]  # one compressor per parameter ([Note: per-parameter compression])
    errors = [
        ([torch.zeros(padded_numel(s, world)) for _ in range(world)],
         [torch.zeros(padded_numel(s, world) // world) for _ in range(world)])
        for s in sizes
    ]  # fmt: skip
    out = []
    for k, (x, y) in enumerate(global_batches(STEPS, MB * GAS * world), start=1):
        local = []
        for r in range(world):
            g = torch.zeros(n)
            for mi in range(GAS):
                vector_to_parameters(flat, params)
                model.zero_grad()
                (F.mse_loss(model(rank_slice(x, mi, r, world, MB)), rank_slice(y, mi, r, world, MB)) / GAS).backward()
                g += parameters_to_vector([p.grad for p in params])
            local.append(g)
        if k > 1:  # step 1 only counts ([Note: 1-bit Adam's phases])
            if k - 1 < max(FREEZE, 2):  # warm-up: the engine's all-reduced mean
                g = torch.stack(local).sum(0) * (1 / world)
                g = g * clip_coefficient(g.norm().item(), CLIP)
                m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            else:  # compressed: local gradients, agreed norm (RMS of local norms), compressed momentum
                norm = math.sqrt(sum(g.square().sum().item() for g in local) / world)
                coef = clip_coefficient(norm, CLIP)
                ms = [m * BETAS[0] + (1 - BETAS[0]) * (g * coef) for g in local]
                pieces = [mr.split(sizes) for mr in ms]
                m = torch.cat([
                    compressed_allreduce([pieces[r][i] for r in range(world)], *errors[i]) for i in range(len(sizes))
                ])  # fmt: skip
            apply_update_(flat, m, v, LR, EPS, WD)
        out.append(flat.clone())
    return out


@pytest.mark.parametrize("world", [WORLD, pytest.param(4, marks=pytest.mark.slow)])
def test_onebit_adam_matches_simulated_workers_and_compresses(dist_run, world: int) -> None:
    results = dist_run(_train, world, "fp32")
    ref = _reference(world)
    r0 = results[0]
    for step in range(STEPS):
        for r, other in enumerate(results[1:], start=1):
            assert torch.equal(r0["params"][step], other["params"][step]), f"rank {r} differs after step {step + 1}"
        torch.testing.assert_close(r0["params"][step], ref[step], atol=2e-5, rtol=0, msg=f"step {step + 1}")
    assert r0["owns"]
    warm, compressed = r0["comms"][1], r0["comms"][-1]
    assert "all_reduce:grads" in warm and not any("compressed" in k for k in warm)
    assert "all_reduce:grads" not in compressed, compressed  # no gradient all-reduce in the compressed phase
    comp_bytes = sum(b for k, (_, b) in compressed.items() if "compressed" in k)
    other = {k for k in compressed if "compressed" not in k}
    assert other <= {"all_reduce:grad_norm", "all_reduce:step_checks"}, other  # two scalars besides
    # per parameter: its padded signs cross twice ((N-1)/N each way) plus 2 (N-1) fp32 scales; on this 510-element
    # model of small tensors the padding and scales weigh (the 1/32 figure is for large buckets)
    per_param = [padded_numel(p.numel(), world) for p in make_model().parameters()]
    assert comp_bytes == sum(2 * (world - 1) / world * (padded / 8) + 2 * (world - 1) * 4 for padded in per_param)
    assert comp_bytes < warm["all_reduce:grads"][1] / 8
    moved = (ref[-1] - ref[0]).abs().max().item()
    assert moved > 1e-3


def _low_precision(rank: int, world: int) -> dict:
    """bf16, then fp16 where rank 1 alone gets an infinite loss at one compressed step (its gradients overflow)."""
    out = {}
    for dtype in ("bf16", "fp16"):
        engine, *_ = shardspeed.initialize(model=make_model(), config=_config(dtype))
        params = []
        for i, (x, y) in enumerate(global_batches(STEPS, MB * GAS * world)):
            if dtype == "fp16" and i == FREEZE + 1 and rank == 1:
                y = y * float("inf")
            _micro_steps(engine, x, y, rank, world)
            params.append(_flat(engine))
        out[dtype] = {"params": params, "owns": engine.optimizer.owns_communication, "skipped": engine.skipped_steps}
        engine.destroy()
    return out


def test_low_precision_ranks_stay_identical_and_skip_together(dist_run) -> None:
    r0, r1 = dist_run(_low_precision, WORLD)
    for dtype in ("bf16", "fp16"):
        assert r0[dtype]["owns"]
        for step in range(STEPS):
            a, b = r0[dtype]["params"][step], r1[dtype]["params"][step]
            assert torch.equal(a, b), f"{dtype}: ranks differ after step {step + 1}"
            assert torch.isfinite(a).all()
        assert not torch.equal(r0[dtype]["params"][-1], r0[dtype]["params"][FREEZE])  # the compressed phase moved
    # rank 1's local overflow (no gradient all-reduce to spread it) is agreed: both ranks skip that step
    assert r0["fp16"]["skipped"] == r1["fp16"]["skipped"] == 1
    assert torch.equal(r0["fp16"]["params"][FREEZE + 1], r0["fp16"]["params"][FREEZE])


def _run_from(rank: int, world: int, ckpt: str, save_at: int, load: bool, reset: bool) -> list[torch.Tensor]:
    """Steps 1..STEPS saving after ``save_at``, or (``load``) steps save_at+1..STEPS from that checkpoint."""
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config())
    batches = global_batches(STEPS, MB * GAS * world)
    start = 0
    if load:
        engine.load_checkpoint(ckpt)
        start = save_at
        if reset:  # what DeepSpeed does on every load: the bit-for-bit comparison must then fail
            engine.optimizer.reset_compression()
    out = []
    for i in range(start, STEPS):
        x, y = batches[i]
        _micro_steps(engine, x, y, rank, world)
        if not load and i + 1 == save_at:
            engine.save_checkpoint(ckpt)
        out.append(_flat(engine))
    engine.destroy()
    return out


def _resume(rank: int, world: int, ckpt: str, save_at: int) -> tuple[list[torch.Tensor], ...]:
    full = _run_from(rank, world, ckpt, save_at, False, False)
    return full, _run_from(rank, world, ckpt, save_at, True, False), _run_from(rank, world, ckpt, save_at, True, True)


def _load_elsewhere(rank: int, world: int, ckpt: str) -> tuple[list[str], float, bool]:
    engine, records = load_with_warnings(_config(), ckpt)
    state = engine.optimizer.compression_state_dict()
    return records, sum(t.abs().sum().item() for t in state.values()), engine.optimizer.owns_communication


def test_resume_keeps_error_buffers_at_the_same_world_only(dist_run, tmp_path) -> None:
    """Same world: the resumed run equals the uninterrupted one bit for bit (and would not with the buffers
    reset). Another world (1): the buffers are reset with one warning, the compressed phase continues."""
    save_at = FREEZE + 2  # inside the compressed phase: error buffers are live
    for r, (full, resumed, reset) in enumerate(dist_run(_resume, WORLD, str(tmp_path), save_at)):
        tail = full[save_at:]
        assert all(torch.equal(a, b) for a, b in zip(tail, resumed)), f"rank {r}: resumed run differs"
        assert not torch.equal(tail[-1], reset[-1])  # without the buffers the run is not the same
    ((records, error_sum, owns),) = dist_run(_load_elsewhere, 1, str(tmp_path))
    assert len([m for m in records if "compression error buffers are reset" in m]) == 1, records
    assert error_sum == 0.0 and owns


def _load_with_damaged_rank1_rows(rank: int, world: int, ckpt: str) -> tuple[str, bool]:
    """Save in the compressed phase, damage rank 1's file (its error-buffer rows), load: the error and whether
    the engine's parameters are untouched."""
    import glob
    import os
    from pathlib import Path

    import torch.distributed as dist

    engine, *_ = shardspeed.initialize(model=make_model(), config=_config())
    for x, y in global_batches(FREEZE + 2, MB * GAS * world):
        _micro_steps(engine, x, y, rank, world)
    engine.save_checkpoint(ckpt, tag="t")
    _micro_steps(engine, *global_batches(1, MB * GAS * world)[0], rank, world)
    dist.barrier()
    if rank == 0:
        for path in glob.glob(os.path.join(ckpt, "t", "rank00001-*.safetensors")):
            data = bytearray(Path(path).read_bytes())
            data[-5] ^= 0xFF  # inside the last chunk's data: rank 1's rows
            Path(path).write_bytes(bytes(data))
    dist.barrier()
    before = _flat(engine)
    try:
        engine.load_checkpoint(ckpt, tag="t")
        error = ""
    except Exception as exc:
        error = str(exc)
    return error, torch.equal(before, _flat(engine))


def test_damaged_error_buffer_rows_fail_before_anything_is_loaded(dist_run, tmp_path) -> None:
    for error, unchanged in dist_run(_load_with_damaged_rank1_rows, WORLD, str(tmp_path)):
        assert "is corrupt" in error and "partly loaded" not in error, error
        assert unchanged


def _save_compressed(rank: int, world: int, ckpt: str) -> None:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config())
    for x, y in global_batches(FREEZE + 2, MB * GAS * world):  # inside the compressed phase: live error buffers
        _micro_steps(engine, x, y, rank, world)
    engine.save_checkpoint(ckpt)
    engine.destroy()


def _load_at_world_and_step(rank: int, world: int, ckpt: str) -> dict:
    engine, records = load_with_warnings(_config(), ckpt)
    error_sum = sum(t.abs().sum().item() for t in engine.optimizer.compression_state_dict().values())
    owns = engine.optimizer.owns_communication
    engine.comms_log.reset()
    _micro_steps(engine, *global_batches(1, MB * GAS * world)[0], rank, world)  # a compressed step at world 4
    compressed = any(k.startswith("all_to_all:compressed") for k in engine.comms_log.rows())
    return {"warnings": [m for m in records if "compression error buffers are reset" in m], "error_sum": error_sum,
            "owns": owns, "compressed": compressed, "params": _flat(engine)}  # fmt: skip


@pytest.mark.slow
def test_world2_checkpoint_at_world4_resets_buffers_and_steps_compressed(dist_run, tmp_path) -> None:
    """Review B #9: at world 1 the compressors hold empty buffers, so also load at world 4 (real shapes)."""
    dist_run(_save_compressed, WORLD, str(tmp_path))
    results = dist_run(_load_at_world_and_step, 4, str(tmp_path))
    assert [len(r["warnings"]) for r in results] == [1, 0, 0, 0]  # one warning, on global rank 0
    for r in results:
        assert r["error_sum"] == 0.0 and r["owns"] and r["compressed"]
        assert torch.isfinite(r["params"]).all() and torch.equal(r["params"], results[0]["params"])
