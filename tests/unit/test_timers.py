from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.comm.blocked import BlockedTime
from shardspeed.timers import PhaseTimers, offload_io_clock
from shardspeed.training import EngineEvents


def test_phase_timers_sum_and_reset() -> None:
    timers = PhaseTimers(True, torch.device("cpu"))
    events = EngineEvents()
    events.subscribe(timers)
    for _ in range(2):
        with events.phase("forward"):
            sum(range(1000))
    assert timers.totals["forward"] > 0
    report = timers.report_and_reset(2)
    assert report.startswith("forward ") and report.endswith(" ms per step")
    assert not timers.totals
    disabled = PhaseTimers(False, torch.device("cpu"))
    unsubscribe = events.subscribe(disabled)
    with events.phase("forward"):
        pass
    assert not disabled.totals
    unsubscribe()
    assert not [1 for _ in range(1) if disabled in events._listeners]


def test_engine_times_each_phase_when_asked() -> None:
    model = torch.nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "wall_clock_breakdown": True,
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    assert set(engine.timers.totals) == {"forward", "backward", "backward_inner", "backward_allreduce", "step"}
    assert set(engine.timers.last_step) == set(engine.timers.totals)  # the last step's figures, for the monitors


class _Timings:
    def __init__(self) -> None:
        self.wait_read_s = 0.0
        self.wait_write_s = 0.0


class _StreamedOptimizer:
    """What ``offload_io_clock`` reads of ``StreamedAdam``: its ``timings`` (offload/stream.py's StreamTimings)."""

    def __init__(self) -> None:
        self.timings = _Timings()


def test_backward_split_and_offload_io_per_step() -> None:
    blocked, optimizer = BlockedTime(), _StreamedOptimizer()
    timers = PhaseTimers(True, torch.device("cpu"), blocked, optimizer)
    events = EngineEvents()
    events.subscribe(timers)
    for _ in range(2):  # two micro-steps, then the optimizer step
        with events.phase("backward"):
            blocked.add("all_reduce:grads", 1e-9)  # the training thread "waited" 1 ns on a reduction
    with events.phase("step"):
        optimizer.timings.wait_read_s += 0.25
        optimizer.timings.wait_write_s += 0.5
    step = timers.last_step
    assert set(step) == {"backward", "backward_allreduce", "backward_inner", "step", "offload_io"}
    assert step["backward_allreduce"] == pytest.approx(2e-9, abs=1e-15)
    assert step["backward_inner"] + step["backward_allreduce"] == pytest.approx(step["backward"], abs=1e-12)
    assert step["offload_io"] == 0.75
    # a blocked meter reset mid-backward (benchmarks do) never makes the split negative
    with events.phase("backward"):
        blocked.reset()
    with events.phase("step"):
        pass
    assert timers.last_step["backward_allreduce"] == 0.0 and timers.last_step["offload_io"] == 0.0
    report = timers.report_and_reset(3)
    names = [part.rsplit(" ", 2)[0] for part in report.removesuffix(" per step").split(", ")]
    assert names == ["backward", "backward_inner", "backward_allreduce", "step", "offload_io"]


def test_no_offload_io_without_a_streamed_optimizer() -> None:
    assert offload_io_clock(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)) is None
    assert offload_io_clock(None) is None
