"""ZeRO-3 (and stage 2) communication costs: no host sync per unit, gradient wire dtype, bucketed reduce-scatter,
and a clear error for parameters read as empty placeholders.

Figures (world 2): the collectives per unit, the bytes of gradient traffic per step under bf16 before/after
the communication-dtype default, and the staging bytes bounded by ``reduce_bucket_size``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardspeed
from shardspeed.zero.stage3.grads import PlaceholderGradientError
from shardspeed.zero.stage3.unit import UnitMismatchError

WIDTH, MB = 24, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, 4),
    )  # fmt: skip


def _config(stage: int = 3, optimizer: str = "sgd", **extra: object) -> dict:
    opt = {"type": "SGD", "params": {"lr": 0.05}} if optimizer == "sgd" else {"type": "AdamW", "params": {"lr": 3e-3}}
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}  # type: ignore[dict-item]
    return {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": opt,
        "zero_optimization": zero,
        "comms_logger": {"enabled": True},
        "steps_per_print": 1000,
        **extra,
    }


def _batches(steps: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(MB * world, WIDTH, generator=g), torch.randn(MB * world, 4, generator=g)) for _ in range(steps)
    ]


def _step(engine, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    rows = slice(rank * MB, (rank + 1) * MB)
    dtype = next(engine.module.parameters()).dtype
    loss = F.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])
    engine.backward(loss)
    engine.step()
    return loss.detach()


# --- no host sync per unit -----------------------------------------------------------------------------------
class _CountHostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what ``.item()``, ``.tolist()`` and ``bool(tensor)`` dispatch to — a
    device-to-host sync on an accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads(rank: int, world: int) -> dict:
    engine, *_ = shardspeed.initialize(model=_model(), config=_config())
    engine.states.id_check.immediate = False  # the device path, on CPU
    batches = _batches(3, world)
    _step(engine, *batches[0], rank)  # first step records the order
    x, y = batches[1]
    rows = slice(rank * MB, (rank + 1) * MB)
    with _CountHostReads() as fwd:
        out = engine(x[rows])
    loss = F.mse_loss(out, y[rows])
    with _CountHostReads() as bwd:
        engine.backward(loss)
    engine.comms_log.reset()
    _step(engine, *batches[2], rank)
    totals = engine.comms_log.totals
    return {
        "forward": fwd.count,
        "backward": bwd.count,
        "units": len(engine.states.units),
        "pieces": sum(len(g.pieces) for g in engine.states.grads),
        "calls": {k: t.count for k, t in totals.items()},
    }


def test_no_host_sync_per_unit_in_forward_and_backward(dist_run) -> None:
    """Steady-state forward and backward read nothing on the host (the old code read the unit ids once per
    gather and reduce-scatter); the step boundary reads all of them at once. Per unit and step: a gather in
    forward and in backward (each: ids + data) and a reduce-scatter (ids + its pieces)."""
    for r in dist_run(_host_reads, 2):
        assert r["forward"] == 0 and r["backward"] == 0
        units = r["units"]
        assert r["calls"]["all_gather:params"] == 2 * units
        assert r["calls"]["reduce_scatter:grads"] == r["pieces"] == units  # one piece each at the default bucket
        assert r["calls"]["all_gather:unit_ids"] == 3 * units


def _swapped_order(rank: int, world: int, immediate: bool) -> str:
    """Rank 1 runs two same-sized layers in the opposite order: collectives match by size, weights would swap."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)])
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    engine.states.id_check.immediate = immediate
    order = [0, 1] if rank == 0 else [1, 0]
    x = torch.randn(MB, WIDTH)
    try:
        h = x
        for i in order:
            h = engine.module[i](h)
        engine.backward(h.pow(2).mean())
        engine.step()
    except UnitMismatchError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("immediate", [True, False])
def test_swapped_same_sized_units_are_an_error_on_every_rank(dist_run, immediate: bool) -> None:
    messages = dist_run(_swapped_order, 2, immediate)
    assert "this rank reached unit '0' while data-parallel rank 1 reached unit '1'" in messages[0]
    assert "this rank reached unit '1' while data-parallel rank 0 reached unit '0'" in messages[1]


# --- gradient wire dtype ---------------------------------------------------------------------------------------
def _grad_traffic(rank: int, world: int, stage: int, comm: str | None) -> dict:
    extra: dict = {"bf16": {"enabled": True}}
    if comm is not None:
        extra["communication_data_type"] = comm
    engine, *_ = shardspeed.initialize(model=_model(), config=_config(stage, **extra))
    batches = _batches(2, world)
    _step(engine, *batches[0], rank)
    engine.comms_log.reset()
    _step(engine, *batches[1], rank)
    log = engine.comms_log.totals
    return {"grad_bytes": sum(t.bytes for k, t in log.items() if k.endswith(":grads"))}


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_bf16_gradients_travel_in_bf16_by_default(dist_run, stage: int) -> None:
    """DeepSpeed's default: the training dtype on the wire — half the bytes of fp32 — unless the config says
    "fp32"."""
    default = dist_run(_grad_traffic, 2, stage, None)[0]["grad_bytes"]
    fp32 = dist_run(_grad_traffic, 2, stage, "fp32")[0]["grad_bytes"]
    numel = sum(p.numel() for p in _model().parameters())
    assert fp32 == 4 * (numel + numel % 2)  # padded to a multiple of the world size
    assert default * 2 == fp32


def _final_loss(rank: int, world: int, comm: str) -> float:
    engine, *_ = shardspeed.initialize(
        model=_model(), config=_config(3, "adamw", bf16={"enabled": True}, communication_data_type=comm)
    )
    batches = _batches(1, world) * 20  # one batch, 20 steps: the loss falls steadily
    losses = [_step(engine, x, y, rank) for x, y in batches]
    return float(losses[-1])


@pytest.mark.slow
def test_bf16_reductions_track_fp32_reductions(dist_run) -> None:
    """20 AdamW steps under bf16: reducing in bf16 instead of fp32 moves the final loss by < 1%."""
    bf16 = dist_run(_final_loss, 2, "bf16")
    fp32 = dist_run(_final_loss, 2, "fp32")
    assert abs(bf16[0] - fp32[0]) <= 0.01 * fp32[0], (bf16, fp32)


# --- reduce_bucket_size at stage 3 -----------------------------------------------------------------------------
def _bucketed(rank: int, world: int, bucket: int, bf16: bool) -> dict:
    extra: dict = {"zero": {"reduce_bucket_size": bucket}}
    if bf16:
        extra["bf16"] = {"enabled": True}
    engine, *_ = shardspeed.initialize(model=_model(), config=_config(3, **extra))
    for x, y in _batches(3, world):
        _step(engine, x, y, rank)
    return {
        "peak": engine.states.peak_staging_bytes,
        "state": {k: v.float() for k, v in engine.module_state_dict().items()},
        "reduce_scatters": engine.comms_log.totals["reduce_scatter:grads"].count,
        "largest_unit": max(u.padded_numel for u in engine.states.units),
    }


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_stage3_staging_is_bounded_by_reduce_bucket_size(dist_run, bf16: bool) -> None:
    elem = 2 if bf16 else 4
    small = dist_run(_bucketed, 2, 64, bf16)
    whole = dist_run(_bucketed, 2, 10**9, bf16)
    for s, w in zip(small, whole):
        assert 0 < s["peak"] <= 64 * elem < s["largest_unit"] * elem
        assert w["peak"] >= w["largest_unit"] * elem  # one piece per unit: the whole unit staged
        assert s["reduce_scatters"] > w["reduce_scatters"]
        for name, value in w["state"].items():  # pieces change nothing but the staging
            assert torch.equal(s["state"][name], value), name


# --- parameters read as placeholders ---------------------------------------------------------------------------
def _penalty(rank: int, world: int, gathered: bool) -> str:
    engine, *_ = shardspeed.initialize(model=_model(), config=_config())
    x = torch.randn(MB, WIDTH)
    loss = engine(x).pow(2).mean()
    params = list(engine.module.parameters())
    try:
        if gathered:  # the penalty's backward reads the parameters again: it runs inside the block too
            with shardspeed.zero.GatheredParameters(params):
                engine.backward(loss + 1e-3 * sum(p.pow(2).sum() for p in params))
        else:
            engine.backward(loss + 1e-3 * sum(p.pow(2).sum() for p in params))
        engine.step()
    except PlaceholderGradientError as err:
        return str(err)
    state = engine.module_state_dict()
    return "no error" if not engine.states.unsharded_units() and len(state) == 6 else "leaked"


def test_parameters_read_outside_forward_are_named(dist_run) -> None:
    for message in dist_run(_penalty, 2, False):
        assert "ZeRO-3 parameter(s) '4.bias', '4.weight', '2.bias'" in message
        assert "were read outside their modules' forward" in message
        assert "shardspeed.zero.GatheredParameters" in message
    assert dist_run(_penalty, 2, True) == ["no error", "no error"]
