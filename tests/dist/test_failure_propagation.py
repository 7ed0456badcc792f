"""Failure propagation (issue 13): an exception on one rank inside an engine call makes every rank raise, naming
the failing rank and its exception, instead of waiting in the next collective. Every case ends by itself; the
harness deadline is only a backstop."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice, train_engine

import shardspeed
from harness import RankFailure

MB = 2
BOUND_S = 10.0  # the bound; each case asserts every rank's error came within it (generous on a loaded box)
DEADLINE_S = 60.0  # harness backstop


def _config(stage: int = 0, **extra: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        "fault_tolerance": {"watch_interval_s": 0.1},
        **extra,
    }


class Flaky(torch.nn.Module):
    """TinyNet whose forward (or backward) raises on one rank at one call."""

    def __init__(self, rank: int, fail_rank: int, fail_call: int, in_backward: bool = False) -> None:
        super().__init__()
        self.net = make_model()
        self.calls = 0
        self.fail = rank == fail_rank
        self.fail_call = fail_call
        self.in_backward = in_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.net(x)
        if self.fail and self.calls == self.fail_call:
            if not self.in_backward:
                raise RuntimeError(f"bad batch at call {self.calls}")
            out = _RaiseInBackward.apply(out)
        return out


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward exploded")


def _train(engine: Any, rank: int, world: int, steps: int, catch: bool = False) -> None:
    for x, y in global_batches(steps, MB * world):
        try:
            out = engine(rank_slice(x, 0, rank, world, MB))
        except RuntimeError:
            if not catch:
                raise
            continue  # the "skip the bad batch" pattern
        engine.backward(F.mse_loss(out, rank_slice(y, 0, rank, world, MB)))
        engine.step()


def _timed(fn: Any, *args: Any) -> tuple[str, float]:
    """(error or "no error", seconds) of fn(*args) on this rank; the clock starts at a barrier-free point."""
    start = time.monotonic()
    try:
        fn(*args)
    except Exception as error:
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _check(results: list[tuple[str, float]], failing: int, origin: str, where: str) -> None:
    for rank, (error, elapsed) in enumerate(results):
        assert elapsed < BOUND_S + 5, f"rank {rank} took {elapsed:.1f}s"
        if rank == failing:
            assert error.startswith(origin), error
        else:
            assert error.startswith("PeerFailedError: "), error
            assert f"rank {failing} failed in {where}" in error and origin in error, error


def _forward_case(rank: int, world: int, stage: int, catch: bool) -> tuple[str, float]:
    model = Flaky(rank, fail_rank=1, fail_call=3)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    return _timed(_train, engine, rank, world, 6, catch)


def test_forward_exception_raises_on_every_rank(dist_run) -> None:
    results = dist_run(_forward_case, 2, 0, False, deadline_s=DEADLINE_S)
    _check(results, 1, "RuntimeError: bad batch at call 3", "engine.forward() at step 2")


def test_skip_bad_batch_is_an_error_on_every_rank(dist_run) -> None:
    """The issue's silent corruption: rank 1 catches its forward's exception and carries on. Before, the ranks'
    gradient all-reduces paired off by one step; now the engine refuses on rank 1 and rank 0 hears why."""
    results = dist_run(_forward_case, 2, 0, True, deadline_s=DEADLINE_S)
    error, _ = results[1]
    assert error.startswith("EngineFailedError: this engine is unusable: rank 1 raised in engine.forward() at step 2")
    assert "bad batch at call 3" in error
    assert results[0][0].startswith("PeerFailedError: rank 1 failed in engine.forward()"), results[0][0]


@pytest.mark.slow
def test_zero3_forward_exception_raises_on_every_rank(dist_run) -> None:
    """ZeRO-3's prefetching gathers (async) are waited through the board too."""
    results = dist_run(_forward_case, 2, 3, False, deadline_s=DEADLINE_S)
    _check(results, 1, "RuntimeError: bad batch at call 3", "engine.forward() at step 2")


def _backward_case(rank: int, world: int, stage: int) -> tuple[str, float]:
    model = Flaky(rank, fail_rank=1, fail_call=2, in_backward=True)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    return _timed(_train, engine, rank, world, 4)


@pytest.mark.slow  # `make test` keeps forward and step of the engine entry points
def test_backward_exception_raises_on_every_rank(dist_run) -> None:
    results = dist_run(_backward_case, 2, 2, deadline_s=DEADLINE_S)
    _check(results, 1, "RuntimeError: backward exploded", "engine.backward() at step 1")


def _step_case(rank: int, world: int, stage: int) -> tuple[str, float]:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    if rank == 1:
        inner_step = engine.optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if engine.global_steps == 1:
                raise RuntimeError("incompatible optimizer state")
            return inner_step(*args, **kwargs)

        engine.optimizer.step = step  # the case: a resumed optimizer state that does not fit
    return _timed(_train, engine, rank, world, 4)


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_step_exception_raises_on_every_rank(dist_run, stage: int) -> None:
    results = dist_run(_step_case, 2, stage, deadline_s=DEADLINE_S)
    _check(results, 1, "RuntimeError: incompatible optimizer state", "engine.step() at step 1")


def _save_case(rank: int, world: int, where: str) -> tuple[str, float]:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1))
    _train(engine, rank, world, 1)
    client = {"note": object()} if rank == 1 else {"note": "fine"}  # only rank 1's client_state is not plain data

    def save_then_train() -> None:
        engine.save_checkpoint(where, client_state=client)
        _train(engine, rank, world, 1)

    return _timed(save_then_train)


@pytest.mark.slow  # `make test` keeps forward and step of the engine entry points
def test_save_checkpoint_exception_raises_on_every_rank(dist_run, tmp_path) -> None:
    results = dist_run(_save_case, 2, str(tmp_path / "ckpt"), deadline_s=DEADLINE_S)
    _check(results, 1, "TypeError: client_state must be plain data", "engine.save_checkpoint() at step 1")
    assert not (tmp_path / "ckpt" / "latest").exists()


def _load_case(rank: int, world: int, where: str) -> tuple[str, float]:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1))
    _train(engine, rank, world, 1)
    engine.save_checkpoint(where)

    def custom(src: dict, dst: torch.nn.Module) -> None:
        if rank == 1:
            raise KeyError("no such weight: 'decoder.weight'")

    def load_then_train() -> None:
        engine.load_checkpoint(where, custom_load_fn=custom)
        _train(engine, rank, world, 1)

    return _timed(load_then_train)


@pytest.mark.slow  # `make test` keeps forward and step of the engine entry points
def test_load_checkpoint_exception_raises_on_every_rank(dist_run, tmp_path) -> None:
    results = dist_run(_load_case, 2, str(tmp_path / "ckpt"), deadline_s=DEADLINE_S)
    _check(results, 1, "KeyError: \"no such weight: 'decoder.weight'\"", "engine.load_checkpoint() at step 1")


def _init_case(rank: int, world: int) -> tuple[str, float]:
    model = make_model()

    def build(params: Any) -> torch.optim.Optimizer:
        if rank == 1:
            raise ValueError("optimizer factory failed on this host")
        return torch.optim.SGD(params, lr=0.05)

    def init_and_train() -> None:
        engine, *_ = shardspeed.initialize(model=model, optimizer=build, config=_config(2, optimizer=None))
        _train(engine, rank, world, 1)

    return _timed(init_and_train)


@pytest.mark.slow  # `make test` keeps forward and step of the engine entry points
def test_initialize_exception_raises_on_every_rank(dist_run) -> None:
    results = dist_run(_init_case, 2, deadline_s=DEADLINE_S)
    _check(results, 1, "ValueError: optimizer factory failed on this host", "shardspeed.initialize()")


def _comms_counts(rank: int, world: int, propagate: bool, where: str) -> dict:
    model = make_model()
    config = _config(2, comms_logger={"enabled": True}, fault_tolerance={"propagate_failures": propagate})
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    train_engine(engine, rank, world, global_batches(3, MB * world), MB, 1)
    engine.save_checkpoint(where)
    counts = {key: (t.count, t.elements) for key, t in engine.comms_log.totals.items()}
    return {"counts": counts, "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}


def test_normal_run_unchanged_by_propagation(dist_run, tmp_path) -> None:
    """The board adds no collectives (comms log counts equal) and changes no figure."""
    on = dist_run(_comms_counts, 2, True, str(tmp_path / "on"))[0]
    off = dist_run(_comms_counts, 2, False, str(tmp_path / "off"))[0]
    assert on["counts"] == off["counts"] and on["counts"]
    for name in on["params"]:
        assert torch.equal(on["params"][name], off["params"][name]), name


def _agreed_error_keeps_engine(rank: int, world: int) -> str:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(0))
    with pytest.raises(RuntimeError, match="missing keys"):
        engine.load_state_dict({})  # agreed across ranks: the same error everywhere, not a failure
    _train(engine, rank, world, 2)
    return "ok"


def test_agreed_error_is_not_a_failure(dist_run) -> None:
    assert dist_run(_agreed_error_keeps_engine, 2) == ["ok", "ok"]


def _kill_case(rank: int, world: int, stage: int) -> tuple[str, float]:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    if rank == 1:  # dies mid-backward at step 2: no exception, no teardown, nothing published by itself
        engine.module.mid.weight.register_hook(
            lambda grad: os.kill(os.getpid(), signal.SIGKILL) if engine.global_steps == 2 else None
        )
    return _timed(_train, engine, rank, world, 6)


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_kill_9_of_a_peer_raises_peer_died(dist_run, stage: int) -> None:
    """Forked ranks (fast); tests/e2e/test_rank_death.py does the same with real processes."""
    with pytest.raises(RankFailure) as info:
        dist_run(_kill_case, 2, stage, deadline_s=DEADLINE_S)
    assert info.value.errors[1][1] == "rank died without reporting"
    error, elapsed = info.value.results[0]
    assert error.startswith("PeerDiedError: rank 1 died: the process exited without reporting an error"), error
    assert "this rank was waiting in" in error or "this rank was entering" in error, error
    assert elapsed < BOUND_S + 5


def _user_exception_case(rank: int, world: int, in_thread: bool, failure_dir: str) -> tuple[str, float]:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(0))
    _train(engine, rank, world, 1)
    if rank == 1:
        os.environ["SHARDSPEED_FAILURE_DIR"] = failure_dir  # the launcher sets it (another helper's part)
        if in_thread:  # threading.excepthook
            worker = threading.Thread(target=_raise_user_bug, name="loader")
            worker.start()
            worker.join()
        else:
            try:
                _raise_user_bug()
            except ValueError:
                sys.excepthook(*sys.exc_info())  # what the interpreter does with an uncaught exception
        return "raised", 0.0
    return _timed(_train, engine, rank, world, 4)


def _raise_user_bug() -> None:
    raise ValueError("user code bug between steps")


@pytest.mark.parametrize("in_thread", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_uncaught_user_exception_is_published(dist_run, tmp_path, in_thread: bool) -> None:
    """sys.excepthook / threading.excepthook publish an exception uncaught in the script (real processes:
    tests/e2e/test_rank_death.py), and the failing rank leaves ``$SHARDSPEED_FAILURE_DIR/rank1.json``."""
    results = dist_run(_user_exception_case, 2, in_thread, str(tmp_path / "failures"), deadline_s=DEADLINE_S)
    error, elapsed = results[0]
    where = "thread 'loader' (uncaught exception)" if in_thread else "user code (uncaught exception)"
    assert error.startswith(f"PeerFailedError: rank 1 failed in {where}: ValueError: user code bug between steps"), (
        error
    )
    assert elapsed < BOUND_S + 5
    record = json.loads((tmp_path / "failures" / "rank1.json").read_text())
    assert (record["rank"], record["where"], record["error"]) == (1, where, "ValueError: user code bug between steps")
    assert not (tmp_path / "failures" / "rank0.json").exists()  # rank 0 did not fail of its own accord


def _agreed_uncaught_case(rank: int, world: int, failure_dir: str) -> str:
    """An agreed error (every rank raises it alike) left uncaught: nothing is published to the peers, but each rank
    leaves a failure record so the launcher can name the cause instead of "exited with code 1"."""
    from shardspeed.faults.errors import mark_agreed

    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(0))
    os.environ["SHARDSPEED_FAILURE_DIR"] = failure_dir
    try:
        raise mark_agreed(ValueError("the same on every rank"))
    except ValueError:
        sys.excepthook(*sys.exc_info())
    _train(engine, rank, world, 1)  # nothing was published: the ranks still train together
    return "trained"


def test_an_uncaught_agreed_error_is_recorded_for_the_launcher_not_published(dist_run, tmp_path) -> None:
    assert dist_run(_agreed_uncaught_case, 2, str(tmp_path / "failures"), deadline_s=DEADLINE_S) == ["trained"] * 2
    for rank in (0, 1):
        record = json.loads((tmp_path / "failures" / f"rank{rank}.json").read_text())
        assert (record["where"], record["error"]) == (
            "user code (uncaught exception)",
            "ValueError: the same on every rank",
        )
