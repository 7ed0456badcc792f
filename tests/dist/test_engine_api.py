"""Engine API through initialize(): the engine's own data loader, user optimizers/schedulers, config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, reference_run

import shardspeed
from shardspeed.config import ConfigError

STEPS, MB, GAS, LR = 4, 2, 2, 0.05


def _train_from_engine_loader(rank: int, world: int) -> dict:
    """Training data given to initialize(): its loader must slice the global batch exactly like the reference."""
    batches = global_batches(STEPS, MB * GAS * world)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    model = make_model()
    config = {
        "train_batch_size": MB * GAS * world,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "steps_per_print": 1000,
    }
    dataset = torch.utils.data.TensorDataset(xs, ys)
    engine, _, loader, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config=config
    )
    # Unshuffled so the global order is the dataset order (the sampler's shuffle is world-size independent anyway).
    assert loader is not None and engine.train_micro_batch_size_per_gpu() == MB
    loader = shardspeed.data.build_dataloader(
        dataset,
        micro_batch_size=MB,
        gradient_accumulation_steps=GAS,
        dp_rank=engine.topology.dp_rank,
        dp_world_size=engine.topology.dp_world_size,
        shuffle=False,
    )
    for x, y in loader:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == STEPS
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_training_from_global_index_loader_matches_reference(dist_run, world: int) -> None:
    results = dist_run(_train_from_engine_loader, world)
    ref, _ = reference_run("sgd", LR, 0.0, global_batches(STEPS, MB * GAS * world))
    for params in results:
        for name, p in params.items():
            assert (p - ref[name]).abs().max().item() <= 1e-5, name


def _user_optimizer(rank: int, world: int, kind: str, bf16: bool) -> dict:
    model = make_model()
    if kind == "instance":
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        optimizer = lambda params: torch.optim.SGD(params, lr=LR)  # noqa: E731
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    config = {"train_micro_batch_size_per_gpu": MB, "steps_per_print": 1000, "bf16": {"enabled": bf16}}
    engine, opt, _, lr_sched = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, lr_scheduler=sched, config=config
    )
    before = [p.detach().float().clone() for p in model.parameters()]
    x, y = global_batches(1, MB * world)[0]
    dtype = next(engine.module.parameters()).dtype
    engine.backward(
        F.mse_loss(engine(x[rank * MB : (rank + 1) * MB].to(dtype)).float(), y[rank * MB : (rank + 1) * MB])
    )
    engine.step()
    moved = max((p.detach().float() - b).abs().max().item() for p, b in zip(model.parameters(), before))
    return {"moved": moved, "lr": engine.get_lr(), "is_torch": isinstance(opt, torch.optim.SGD), "sched": lr_sched}


@pytest.mark.parametrize("kind", ["instance", "callable"])
@pytest.mark.parametrize("bf16", [False, True])
def test_user_optimizer_and_scheduler(dist_run, kind: str, bf16: bool) -> None:
    for r in dist_run(_user_optimizer, 2, kind, bf16):
        assert r["moved"] > 1e-4 and r["is_torch"]
        assert r["lr"] == [LR * 0.5]  # the user's scheduler stepped once


def _bad_config(rank: int, world: int) -> str:
    model = make_model()
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as info:
        shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return str(info.value)


def test_bad_config_same_error_on_every_rank(dist_run) -> None:
    messages = dist_run(_bad_config, 2)
    assert messages[0] == messages[1]
    assert "6" in messages[0] and "data-parallel world size" in messages[0]


class SignSGD(torch.optim.Optimizer):
    """A user's own element-wise optimizer: w -= lr * sign(g)."""

    shardspeed_elementwise = True

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad.sign() * group["lr"])


class UnmarkedSGD(SignSGD):
    shardspeed_elementwise = False


def _custom_optimizer(rank: int, world: int, cls: type, allow: bool) -> object:
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50},
        "zero_allow_untested_optimizer": allow,
        "steps_per_print": 1000,
    }
    try:
        engine, *_ = shardspeed.initialize(
            model=model, model_parameters=model.parameters(), optimizer=lambda ps: cls(ps, lr=0.01), config=config
        )
    except ValueError as err:
        return str(err)
    for x, y in global_batches(3, MB * world):
        engine.backward(F.mse_loss(engine(x[rank * MB : (rank + 1) * MB]), y[rank * MB : (rank + 1) * MB]))
        engine.step()
    engine.states.wait_params()  # direct reads below: land pending parameter gathers first
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_users_elementwise_optimizer_runs_on_shards(dist_run) -> None:
    results = dist_run(_custom_optimizer, 2, SignSGD, False)
    model = make_model()
    opt = SignSGD(model.parameters(), lr=0.01)
    for x, y in global_batches(3, MB * 2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for name, p in model.named_parameters():
        assert (results[0][name] - p).abs().max().item() <= 1e-6, name


def test_unknown_optimizer_on_shards_needs_permission(dist_run) -> None:
    message = dist_run(_custom_optimizer, 2, UnmarkedSGD, False)[0]
    assert "UnmarkedSGD is not known to be element-wise" in message and "zero_allow_untested_optimizer" in message
    assert isinstance(dist_run(_custom_optimizer, 2, UnmarkedSGD, True)[0], dict)
