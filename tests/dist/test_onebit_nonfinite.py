"""A NaN on one rank only, while the optimizer owns communication (fp32, no clipping, the default non-finite
policy: nothing else asks for the gradient norm): the step core must still agree on the verdict, so both ranks
skip the step and stay identical. Without the agreement (``training/step_core.py``: the local verdict in the step
checks) rank 1 would fold NaN into its momentum and spread it through the compressed mean. The verdict costs no
collective of its own: a clean compressed step issues the step checks and the compressed all-reduce only. Also
under bf16 with a frozen first layer (its weight takes no part: no gradient in the flat buffer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice
from torch.nn.utils import parameters_to_vector

import shardspeed

STEPS, MB, NAN_AT = 7, 2, 5  # NAN_AT (1-based): inside the compressed phase of both cases
CASES = {
    "OneBitAdam": {"lr": 0.02, "freeze_step": 3},
    "ZeroOneAdam": {"lr": 0.02, "var_freeze_step": 100, "var_update_scaler": 1},  # step 5: a 1-bit mean
}
RUNS = [("OneBitAdam", "fp32"), ("ZeroOneAdam", "fp32"), ("OneBitAdam", "bf16+frozen")]


def _train(rank: int, world: int, name: str, variant: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": name, "params": CASES[name]},
        "steps_per_print": 1000,
        "comms_logger": {"enabled": True},
    }
    model = make_model()
    if variant == "bf16+frozen":  # weight decay would move a frozen weight the optimizer wrongly stepped
        config["bf16"] = {"enabled": True}
        config["optimizer"]["params"] = {**CASES[name], "weight_decay": 0.1}
        next(model.parameters()).requires_grad_(False)
    engine, *_ = shardspeed.initialize(model=model, config=config)
    dtype = next(engine.module.parameters()).dtype
    first = next(engine.module.parameters()).detach().float().clone()
    params, ops = [], []
    for step, (x, y) in enumerate(global_batches(STEPS, MB * world), start=1):
        xs = rank_slice(x, 0, rank, world, MB).to(dtype)
        if step == NAN_AT and rank == 1:
            xs = xs.clone()
            xs[0, 0] = float("nan")
        engine.comms_log.reset()
        engine.backward(F.mse_loss(engine(xs).float(), rank_slice(y, 0, rank, world, MB)))
        engine.step()
        ops.append(sorted(engine.comms_log.rows()))
        params.append(parameters_to_vector([p.detach().float() for p in engine.module.parameters()]).clone())
    out = {"params": params, "skipped": engine.skipped_steps, "owns": engine.optimizer.owns_communication, "ops": ops}
    out["frozen_moved"] = not torch.equal(next(engine.module.parameters()).detach().float(), first)
    out["norm"] = engine.get_global_grad_norm()  # nothing computed it: the verdict alone does not make a norm
    engine.destroy()
    return out


@pytest.mark.parametrize("name,variant", RUNS)
def test_a_nan_on_one_rank_is_skipped_by_every_rank(dist_run, name: str, variant: str) -> None:
    r0, r1 = dist_run(_train, 2, name, variant)
    assert r0["owns"] and r1["owns"]
    assert r0["skipped"] == r1["skipped"] == 1
    for step in range(STEPS):
        assert torch.isfinite(r0["params"][step]).all() and torch.isfinite(r1["params"][step]).all(), step + 1
        assert torch.equal(r0["params"][step], r1["params"][step]), step + 1
    assert torch.equal(r0["params"][NAN_AT - 1], r0["params"][NAN_AT - 2])  # the step was skipped
    assert not torch.equal(r0["params"][-1], r0["params"][NAN_AT - 1])  # and training went on
    last = r0["ops"][-1]  # a clean compressed step: no gradient all-reduce, no norm all-reduce
    assert "all_reduce:step_checks" in last and not {"all_reduce:grads", "all_reduce:grad_norm"} & set(last), last
    assert any("compressed" in op for op in last), last
    assert r0["norm"] is None
    assert not r0["frozen_moved"] or variant != "bf16+frozen"  # a frozen weight never moves (no weight decay)
