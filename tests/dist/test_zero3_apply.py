"""``module.apply(init_fn)`` after ``initialize`` under ZeRO-3: never silent.

A plain ``engine.module.apply(fn)`` writes into empty placeholders; the next forward raises
PlaceholderWriteError naming the parameter (zero/stage3/apply_guard.py) — before, the write was silently lost
and training went on from the old weights. ``shardspeed.zero.apply(engine.module, fn)`` does what DeepSpeed's
``override_module_apply`` does: each module's parameters are gathered around ``fn`` and rank 0's result is kept,
so training matches plain torch started from ``model.apply(fn)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice

import shardspeed
from harness import error_of
from shardspeed import zero

STEPS, MB, LR = 3, 2, 0.05


def _config(override_module_apply: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        # biases (<= 13 elements) persistent: kept whole, the guard watches them too
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 13,
            "override_module_apply": override_module_apply,
        },
        "steps_per_print": 1000,
        # The guard's error is rank-local (a rank that applied alone must not go on), so with failure propagation on
        # the engine refuses every later call; off here so the test can read back what the write did.
        "fault_tolerance": {"propagate_failures": False},
    }


def init_fn(module: torch.nn.Module) -> None:
    """Random, so ranks seeded differently produce different values (rank 0's must win)."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.3)
        torch.nn.init.uniform_(module.bias, -0.1, 0.1)


def _step(engine: shardspeed.ShardSpeedEngine, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> None:
    engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, MB)), rank_slice(y, 0, rank, world, MB)))
    engine.step()


def _plain_apply(rank: int, world: int, override: bool) -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config(override))
    before = engine.module_state_dict()
    torch.manual_seed(100 + rank)
    engine.module.apply(init_fn)
    (x, y), *_ = global_batches(1, MB * world)
    error = error_of(lambda: _step(engine, x, y, rank, world))
    return {"error": error, "before": before, "after": engine.module_state_dict()}


def test_module_apply_after_initialize_raises_at_next_forward(dist_run) -> None:
    for r in dist_run(_plain_apply, 2, True):
        assert r["error"].startswith(
            "PlaceholderWriteError: ZeRO-3 parameters 'inp.bias' (unit '<persistent>'), 'mid.bias' (unit "
            "'<persistent>'), 'mid2.bias' (unit '<persistent>') and 5 more were modified in place outside a gathered"
        )
        assert "shardspeed.zero.apply(engine.module, init_fn)" in r["error"]
        for name, value in r["after"].items():
            if name.endswith("weight"):  # partitioned: the write went nowhere (and no step ran)
                assert torch.equal(value, r["before"][name]), name
            else:  # persistent copies changed on this rank only (ranks now disagree): why it must be an error
                assert not torch.equal(value, r["before"][name]), name


def test_override_module_apply_false_skips_the_check(dist_run) -> None:
    for r in dist_run(_plain_apply, 2, False):
        assert r["error"] == "no error"  # DeepSpeed's override_module_apply: false (placeholders seen, no check)


def _zero_apply_then_train(rank: int, world: int) -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=_config())
    torch.manual_seed(100 + rank)
    zero.apply(engine.module, init_fn)
    applied = engine.module_state_dict()
    for x, y in global_batches(STEPS, MB * world):
        _step(engine, x, y, rank, world)
    return {"applied": applied, "trained": engine.module_state_dict()}


def test_zero_apply_gathers_and_keeps_rank0_result(dist_run) -> None:
    results = dist_run(_zero_apply_then_train, 2)
    expected = make_model()
    torch.manual_seed(100)
    expected.apply(init_fn)  # same order as zero.apply: children before parents
    for r in results:
        for name, value in expected.state_dict().items():
            assert torch.equal(r["applied"][name], value), name

    ref, _ = _reference_from(expected.state_dict())
    for r in results:
        for name, value in ref.items():
            assert (r["trained"][name] - value).abs().max().item() <= 1e-5, name


def _reference_from(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch from ``state`` (reference_run starts from make_model(); load the applied weights first)."""
    model = make_model()
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in global_batches(STEPS, MB * 2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, []


def test_zero_apply_without_zero3_is_module_apply() -> None:
    model, expected = make_model(), make_model()
    torch.manual_seed(7)
    zero.apply(model, init_fn)
    torch.manual_seed(7)
    expected.apply(init_fn)
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
