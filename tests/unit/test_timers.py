from __future__ import annotations

import torch

import shardspeed
from shardspeed.timers import PhaseTimers
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
    assert set(engine.timers.totals) == {"forward", "backward", "step"}
