"""bf16 master weights, gradients and optimizer states (``bf16.bf16_master_weights_and_grads`` +
``bf16_optimizer_states``) and ``torch_autocast`` at ZeRO stages 0-3, against plain torch.

Reference ([Note: low-precision masters] in config/precision.py): plain torch with the model in bf16, torch's
AdamW/SGD stepping the bf16 parameters. It mirrors the engine's arithmetic: each rank's half of the global batch
is back-propagated separately (bf16 gradients), the halves are summed in bf16 and halved (what a bf16 all-reduce /
reduce-scatter of two ranks followed by the 1/N post-scale computes), then the optimizer steps. With that mirror
every operation is the same bf16 operation in the same order (element-wise optimizers cannot tell a bucket slice
or a shard from a parameter): measured 0 ulps at every stage for AdamW and SGD, with and without autocast, GAS 1
and 2. The asserted tolerance is one bf16 ulp per element: CPU kernels may evaluate ``p + alpha·buf`` with or
without an fp32 FMA depending on a tensor's length and alignment (at lr 0.01, SGD's update on a bucket slice vs a
whole parameter differed by one ulp in one element), which can flip a bf16 rounding. The tolerance is tight: fp32
masters (the lr is small enough that bf16 masters drop part of each update) land 14 ulps away, and summing the
micro-steps in the other stage family's order 8 ulps away. A reference that back-propagated the whole
global batch at once would differ by bf16 rounding of the weight-gradient matmul, hence the mirror.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, global_batches, make_model, rank_slice

import shardspeed

MB, LR = 2, 1e-3
FULL_BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _optimizer_config(kind: str) -> dict[str, Any]:
    if kind == "adamw":
        return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    return {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}


def _torch_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        # the engine's config-built AdamW runs torch's fused kernel ([Note: fused Adam by default]), whose bf16 math
        # is done in fp32 inside the kernel: the per-tensor loop's bf16 ops land ~19 ulps away
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _config(stage: int, kind: str, *, bf16: dict | None = None, autocast: bool = False, gas: int = 1) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": _optimizer_config(kind),
        "bf16": FULL_BF16 if bf16 is None else bf16,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if autocast:
        config["torch_autocast"] = {"enabled": True, "dtype": "torch.bfloat16"}
    return config


def _mirrored_reference(
    kind: str, batches: list, world: int, *, bf16_params: bool, autocast: bool
) -> dict[str, torch.Tensor]:
    """Plain torch, one backward per rank's slice, slices' gradients summed in the parameters' dtype and
    multiplied by 1/world (the engine's all-reduce + post-scale), then the torch optimizer."""
    model = make_model()
    if bf16_params:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = _torch_optimizer(kind, params)
    dtype = params[0].dtype
    for x, y in batches:
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(rank_slice(x, 0, r, world, MB).to(dtype))
            F.mse_loss(out.float(), rank_slice(y, 0, r, world, MB)).backward()
            per_rank.append([p.grad for p in params])
        for i, p in enumerate(params):
            total = per_rank[0][i]
            for grads in per_rank[1:]:
                total = total + grads[i]
            p.grad = total * (1.0 / world) if world > 1 else total
        opt.step()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _train(rank: int, world: int, stage: int, kind: str, steps: int, autocast: bool, bf16: dict | None) -> dict:
    model = make_model()
    config = _config(stage, kind, bf16=bf16, autocast=autocast)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = next(iter(engine.module.parameters())).dtype
    out_dtypes = set()
    for x, y in global_batches(steps, MB * world):
        out = engine(rank_slice(x, 0, rank, world, MB).to(dtype))
        out_dtypes.add(out.dtype)
        engine.backward(F.mse_loss(out.float(), rank_slice(y, 0, rank, world, MB)))
        engine.step()
    opt_state = engine.optimizer.state
    state_dtypes = {t.dtype for s in opt_state.values() for k, t in s.items() if k != "step" and t.numel() > 0}
    return {
        "params": full_params(engine),
        "param_dtype": dtype,
        "out_dtypes": out_dtypes,
        "state_dtypes": state_dtypes,
        "buffers": {k: v.dtype for k, v in engine.states.buffers().items() if isinstance(v, torch.Tensor)},
        "accessors": (
            engine.bf16_master_weights_and_gradients(),
            engine.bf16_optimizer_states(),
            engine.torch_autocast_enabled(),
            engine.torch_autocast_dtype(),
        ),
    }


def _max_ulps(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest distance in bf16 ulps of the reference value (ulp(v) = 2^(floor(log2 |v|) - 7))."""
    worst = 0.0
    for name, value in reference.items():
        ulp = torch.exp2(torch.floor(torch.log2(value.abs().clamp_min(2.0**-30))) - 7)
        worst = max(worst, ((params[name] - value).abs() / ulp).max().item())
    return worst


def _assert_parity(results: list[dict], reference: dict[str, torch.Tensor], atol: float | None = None) -> None:
    for r in results:
        if atol is None:
            assert _max_ulps(r["params"], reference) <= 1.0
        else:
            for name, value in reference.items():
                diff = (r["params"][name] - value).abs().max().item()
                assert diff <= atol, (name, diff)


STEPS = 4


def _assert_bf16_masters(results: list[dict]) -> None:
    for r in results:
        assert r["param_dtype"] == torch.bfloat16
        assert r["state_dtypes"] == {torch.bfloat16}  # bf16_optimizer_states: Adam's moments in bf16
        # no fp32 master copy; the gradient buffer / shard is bf16
        assert not any("master" in k for k in r["buffers"]), r["buffers"]
        assert all(dt == torch.bfloat16 for dt in r["buffers"].values()), r["buffers"]


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s != 1 else 1 for s in (0, 1, 2, 3)])
def test_bf16_masters_match_plain_torch_bf16_adamw(dist_run, stage: int) -> None:
    results = dist_run(_train, 2, stage, "adamw", STEPS, False, None)
    reference = _mirrored_reference("adamw", global_batches(STEPS, MB * 2), 2, bf16_params=True, autocast=False)
    _assert_parity(results, reference)
    _assert_bf16_masters(results)


@pytest.mark.slow
def test_fp32_masters_fall_outside_the_parity_tolerance(dist_run) -> None:
    """The one-ulp tolerance above separates bf16 masters from fp32 ones (a silent fallback would be caught)."""
    fp32_masters = dist_run(_train, 2, 1, "adamw", STEPS, False, {"enabled": True})
    reference = _mirrored_reference("adamw", global_batches(STEPS, MB * 2), 2, bf16_params=True, autocast=False)
    assert _max_ulps(fp32_masters[0]["params"], reference) > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_masters_match_plain_torch_bf16_sgd(dist_run, stage: int) -> None:
    results = dist_run(_train, 2, stage, "sgd", STEPS, False, None)
    reference = _mirrored_reference("sgd", global_batches(STEPS, MB * 2), 2, bf16_params=True, autocast=False)
    _assert_parity(results, reference)
    assert results[0]["state_dtypes"] == {torch.bfloat16}  # momentum buffers


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_bf16_full_with_torch_autocast_matches_plain_torch(dist_run, stage: int) -> None:
    # DeepSpeedExamples training/bf16_master_weight's bf16_full.json
    results = dist_run(_train, 2, stage, "adamw", STEPS, True, None)
    reference = _mirrored_reference("adamw", global_batches(STEPS, MB * 2), 2, bf16_params=True, autocast=True)
    _assert_parity(results, reference)
    _assert_bf16_masters(results)
    assert results[0]["accessors"] == (True, True, True, torch.bfloat16)  # DeepSpeed's engine accessors


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_torch_autocast_with_fp32_parameters_matches_plain_torch_autocast(dist_run, world: int) -> None:
    """DeepSpeed's parameter-dtype rule: torch_autocast alone keeps fp32 parameters; only the forward's ops run in
    bf16 (the output of the last Linear is bf16)."""
    results = dist_run(_train, world, 1 if world > 1 else 0, "adamw", STEPS, True, {"enabled": False})
    reference = _mirrored_reference("adamw", global_batches(STEPS, MB * world), world, bf16_params=False, autocast=True)
    _assert_parity(results, reference, atol=1e-6)  # fp32 sums of the two ranks' gradients: same order, exact
    for r in results:
        assert r["param_dtype"] == torch.float32 and r["out_dtypes"] == {torch.bfloat16}
        assert r["state_dtypes"] == {torch.float32}


def _gas_reference(batches: list, world: int, gas: int, micro_first: bool) -> dict[str, torch.Tensor]:
    """bf16 gradient accumulation in the engine's order: stages 0/1 accumulate each rank's micro-steps in its
    buffer and reduce once (``micro_first=False``); stages 2/3 reduce every micro-step and add the reduced slices
    into the gradient shard (``micro_first=True``). Loss scaled by 1/GAS before backward, as engine.backward."""
    model = make_model().to(torch.bfloat16)
    params = list(model.parameters())
    opt = _torch_optimizer("adamw", params)
    for x, y in batches:
        grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        for m in range(gas):
            for r in range(world):
                model.zero_grad(set_to_none=True)
                out = model(rank_slice(x, m, r, world, MB).bfloat16())
                (F.mse_loss(out.float(), rank_slice(y, m, r, world, MB)) * (1.0 / gas)).backward()
                grads[(r, m)] = [p.grad for p in params]
        for i, p in enumerate(params):
            if micro_first:
                reduced = [sum_in_order([grads[(r, m)][i] for r in range(world)]) * (1.0 / world) for m in range(gas)]
                p.grad = sum_in_order(reduced)
            else:
                per_rank = [sum_in_order([grads[(r, m)][i] for m in range(gas)]) for r in range(world)]
                p.grad = sum_in_order(per_rank) * (1.0 / world)
        opt.step()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def _train_gas(rank: int, world: int, stage: int, gas: int, steps: int) -> dict[str, torch.Tensor]:
    model = make_model()
    config = _config(stage, "adamw", gas=gas)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in global_batches(steps, MB * world * gas):
        for m in range(gas):
            out = engine(rank_slice(x, m, rank, world, MB).bfloat16())
            engine.backward(F.mse_loss(out.float(), rank_slice(y, m, rank, world, MB)))
            engine.step()
    return full_params(engine)


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s != 2 else 2 for s in (0, 1, 2, 3)])
def test_bf16_gradient_accumulation_matches_plain_torch(dist_run, stage: int) -> None:
    """Gradients accumulate across micro-steps in bf16 (no fp32 buffer), in the order each stage sums them."""
    gas = 2
    results = dist_run(_train_gas, 2, stage, gas, STEPS)
    reference = _gas_reference(global_batches(STEPS, MB * 2 * gas), 2, gas, micro_first=stage >= 2)
    for params in results:
        assert _max_ulps(params, reference) <= 1.0
