"""The engine's event interface (training/events.py): what listeners hear, in which order, with which figures."""

from __future__ import annotations

import math

import pytest
import torch

import shardspeed
from shardspeed.training import EngineEvents, StepReport


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_phase_start(self, phase: str) -> None:
        self.calls.append(("start", phase))

    def on_phase_end(self, phase: str) -> None:
        self.calls.append(("end", phase))

    def on_step(self, report: StepReport) -> None:
        self.calls.append(("step", report))


class StepsOnly:
    def __init__(self) -> None:
        self.reports: list[StepReport] = []

    def on_step(self, report: StepReport) -> None:
        self.reports.append(report)


def _engine(extra: dict | None = None) -> shardspeed.ShardSpeedEngine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000,
        **(extra or {}),
    }
    engine, *_ = shardspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
    return engine


def test_listeners_hear_phases_and_one_report_per_optimizer_step() -> None:
    engine = _engine({"gradient_clipping": 1.0})
    recorder, steps_only = Recorder(), StepsOnly()
    engine.events.subscribe(recorder)
    engine.events.subscribe(steps_only)  # a listener may implement only some methods
    losses = []
    for _ in range(4):  # GAS 2: two optimizer steps
        loss = engine(torch.randn(2, 4)).square().mean()
        losses.append(loss.detach())
        engine.backward(loss)
        engine.step()
    kinds = [kind if kind == "step" else f"{kind}:{what}" for kind, what in recorder.calls]
    micro = ["start:forward", "end:forward", "start:backward", "end:backward"]
    boundary = [*micro, "start:step", "step", "end:step"]
    assert kinds == micro + boundary + micro + boundary
    reports = [what for kind, what in recorder.calls if kind == "step"]
    assert reports == steps_only.reports
    assert [r.global_step for r in reports] == [1, 2]
    assert [r.global_samples for r in reports] == [4, 8]
    assert torch.equal(reports[-1].loss, losses[-1])
    assert reports[-1].lr == (0.1,)
    assert reports[-1].grad_norm == pytest.approx(engine.get_global_grad_norm())  # clipping asks for the norm
    assert reports[-1].loss_scale is None and not reports[-1].skipped


def test_fp16_overflow_is_reported_as_a_skipped_step() -> None:
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 4}, "gradient_accumulation_steps": 1})
    steps = StepsOnly()
    engine.events.subscribe(steps)
    loss = engine(torch.randn(2, 4).half()).float().sum() * float("inf")
    engine.backward(loss)
    engine.step()
    (report,) = steps.reports
    assert report.skipped and engine.skipped_steps == 1 and engine.global_steps == 1
    assert report.loss_scale == engine.loss_scaler.scale
    assert report.grad_norm is not None and not math.isfinite(report.grad_norm)


def test_unsubscribe_and_phase_end_on_error() -> None:
    events = EngineEvents()
    recorder = Recorder()
    unsubscribe = events.subscribe(recorder)
    with pytest.raises(ValueError), events.phase("backward"):
        raise ValueError("boom")
    assert recorder.calls == [("start", "backward"), ("end", "backward")]  # a timer never stays open
    unsubscribe()
    with events.phase("forward"):
        pass
    assert len(recorder.calls) == 2
