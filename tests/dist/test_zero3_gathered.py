"""zero.GatheredParameters, full_shape / full_numel and register_external_parameter under ZeRO-3.

Expectations come from plain torch: the initial weights of the deterministic parity model, and a single-process
training run started from the edited weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import IN, OUT, global_batches, make_model, rank_slice

import shardspeed
from shardspeed import zero

STEPS, MB, LR = 3, 2, 0.05


def _config(stage: int = 3, precision: str = "fp32", lr: float = LR) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1000,
    }


def _new_mid_weight() -> torch.Tensor:
    return torch.linspace(-1, 1, 13 * 13).view(13, 13)


def _train(engine: shardspeed.ShardSpeedEngine, rank: int, world: int) -> None:
    for x, y in global_batches(STEPS, MB * world):
        dtype = next(engine.module.parameters()).dtype
        loss = F.mse_loss(
            engine(rank_slice(x, 0, rank, world, MB).to(dtype)).float(), rank_slice(y, 0, rank, world, MB)
        )
        engine.backward(loss)
        engine.step()


def _gather_edit_train(rank: int, world: int) -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config())
    model = engine.module
    weight, bias = model.mid.weight, model.out.bias
    out: dict = {
        "outside": (weight.numel(), tuple(weight.shape)),
        "full": (tuple(zero.full_shape(weight)), zero.full_numel(weight)),
        "plain": (tuple(zero.full_shape(torch.ones(2, 3))), zero.full_numel(torch.ones(2, 3))),
    }
    with zero.GatheredParameters([bias, weight]):  # read-only
        out["read"] = (weight.detach().clone(), bias.detach().clone())
    out["after_read"] = weight.numel()
    with zero.GatheredParameters(model.parameters(), modifier_rank=0), torch.no_grad():
        if rank == 0:
            weight.copy_(_new_mid_weight())  # in place
            bias.data = torch.full((OUT,), 0.25)  # or by replacing .data
        else:
            weight.fill_(-7.0)  # edits on other ranks are overwritten
            bias.data = torch.full((OUT,), 9.0)
    out["after_edit"] = {k: v.clone() for k, v in engine.module_state_dict().items()}
    _train(engine, rank, world)
    out["trained"] = {k: v.clone() for k, v in engine.module_state_dict().items()}
    return out


def _reference_after_edit(world: int) -> dict[str, torch.Tensor]:
    model = make_model()
    with torch.no_grad():
        model.mid.weight.copy_(_new_mid_weight())
        model.out.bias.fill_(0.25)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in global_batches(STEPS, MB * world):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_read_edit_on_one_rank_and_train_on(dist_run) -> None:
    results = dist_run(_gather_edit_train, 2)
    initial = make_model()
    reference = _reference_after_edit(2)
    for r in results:
        assert r["outside"] == (0, (0,))  # an empty placeholder outside the block
        assert r["full"] == ((13, 13), 169)
        assert r["plain"] == ((2, 3), 6)
        assert torch.equal(r["read"][0], initial.mid.weight) and torch.equal(r["read"][1], initial.out.bias)
        assert r["after_read"] == 0
        assert torch.equal(r["after_edit"]["mid.weight"], _new_mid_weight())
        assert torch.equal(r["after_edit"]["out.bias"], torch.full((OUT,), 0.25))
        assert torch.equal(r["after_edit"]["inp.weight"], initial.inp.weight)  # the rest is untouched
        for name, tensor in reference.items():
            assert (r["trained"][name] - tensor).abs().max().item() <= 1e-5, name


def _edit_under_bf16(rank: int, world: int) -> dict:
    """lr 0: the step copies the fp32 master shards back into the bf16 shards; if the edit had not reached the
    masters, the parameters would snap back to their old values."""
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config(precision="bf16", lr=0.0))
    weight = engine.module.mid.weight
    with zero.GatheredParameters(weight, modifier_rank=1), torch.no_grad():
        if rank == 1:
            weight.copy_(_new_mid_weight())
    _train(engine, rank, world)
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


def test_edit_reaches_fp32_masters(dist_run) -> None:
    for state in dist_run(_edit_under_bf16, 2):
        assert torch.equal(state["mid.weight"], _new_mid_weight().to(torch.bfloat16))
        assert torch.equal(state["inp.weight"], make_model().inp.weight.to(torch.bfloat16))


def _not_partitioned(rank: int, world: int) -> tuple:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config(stage=1))
    weight = engine.module.mid.weight
    with zero.GatheredParameters(weight, modifier_rank=0):
        inside = weight.detach().clone()
    return inside, tuple(zero.full_shape(weight))


def test_no_op_for_parameters_stage3_does_not_partition(dist_run) -> None:
    for inside, shape in dist_run(_not_partitioned, 2):
        assert torch.equal(inside, make_model().mid.weight) and shape == (13, 13)


# --- register_external_parameter ------------------------------------------------------------------------------
HIDDEN = 6


class Head(nn.Module):
    """Projects onto the input layer's weight by reading it directly (a hand-written tie)."""

    def __init__(self, source: nn.Linear, register: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self._source = [source]  # not a child: the weight belongs to another module
        if register:
            zero.register_external_parameter(self, source.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) @ self._source[0].weight


class HandTied(nn.Module):
    def __init__(self, register: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)])
        self.head = Head(self.inp, register)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)[..., :OUT]


def _hand_tied(rank: int, world: int, register: bool, under_init: bool) -> dict:
    torch.manual_seed(0)
    if under_init:
        with zero.Init():
            model = HandTied(register)
    else:
        model = HandTied(register)
    engine, *_ = shardspeed.initialize(model=model, config=_config())
    _train(engine, rank, world)
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("under_init", [False, True])
def test_external_parameter_is_gathered_around_the_user(dist_run, under_init: bool) -> None:
    results = dist_run(_hand_tied, 2, True, under_init)
    torch.manual_seed(0)
    model = HandTied(register=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in global_batches(STEPS, MB * 2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for state in results:
        for name, tensor in model.state_dict().items():
            assert (state[name] - tensor).abs().max().item() <= 1e-5, name


def test_unregistered_external_use_fails_on_every_rank(dist_run) -> None:
    with pytest.raises(AssertionError) as failure:
        dist_run(_hand_tied, 2, False, False)
    assert len(failure.value.messages()) == 2


def _register_late(rank: int, world: int) -> str:
    engine, *_ = shardspeed.initialize(model=HandTied(register=False), config=_config())
    try:
        zero.register_external_parameter(engine.module.head, engine.module.inp.weight)
    except RuntimeError as error:
        return str(error)
    return ""


def test_register_after_initialize_is_an_error(dist_run) -> None:
    for message in dist_run(_register_late, 2):
        assert "before" in message and "initialize" in message


def _register_foreign(rank: int, world: int) -> None:
    model, stray = make_model(), nn.Linear(2, 2)
    zero.register_external_parameter(model.mid, stray.weight)
    shardspeed.initialize(model=model, config=_config())


def test_external_parameter_must_belong_to_the_model(dist_run) -> None:
    with pytest.raises(AssertionError, match=r"module 'mid' \(Linear\) registered a parameter of shape \(2, 2\)"):
        dist_run(_register_foreign, 2)


def _registry_is_weak(rank: int, world: int) -> tuple[int, int, int]:
    import gc

    from shardspeed.zero.stage3.registry import PARTITIONED

    before = len(PARTITIONED)
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config())
    during = len(PARTITIONED)
    engine.destroy()  # drops the gradient hooks: torch keeps tensors with hooks alive from C++, beyond gc's sight
    del engine, _
    gc.collect()
    return before, during, len(PARTITIONED)


def test_registry_keeps_nothing_alive(dist_run) -> None:
    """full_shape's lookup has no attribute on the parameter and must not leak engines: once the engine and the
    model are gone, so are their entries."""
    for before, during, after in dist_run(_registry_is_weak, 2):
        assert during == before + 8 and after == before
