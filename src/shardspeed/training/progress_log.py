"""The rank-0 progress line every ``steps_per_print`` steps: loss, learning rates, gradient norm, loss scale,
samples per second (and, with ``wall_clock_breakdown``, time per phase). An ``EngineListener``."""

from __future__ import annotations

import logging
import time

from shardspeed.timers import PhaseTimers
from shardspeed.training.events import StepReport

__all__ = ["ProgressLog"]


class ProgressLog:
    def __init__(self, logger: logging.Logger, steps_per_print: int, timers: PhaseTimers, global_rank: int) -> None:
        self.logger = logger
        self.steps_per_print = steps_per_print
        self.timers = timers
        self.global_rank = global_rank
        self._last = (time.perf_counter(), 0)

    def on_step(self, report: StepReport) -> None:
        if report.global_step % self.steps_per_print != 0:
            return
        now = time.perf_counter()
        then, samples_then = self._last
        self._last = (now, report.global_samples)
        # every rank resets its timers, so a later report covers the same window everywhere
        breakdown = self.timers.report_and_reset(self.steps_per_print) if self.timers.enabled else None
        if self.global_rank != 0:
            return
        rate = (report.global_samples - samples_then) / max(now - then, 1e-9)
        loss = float(report.loss) if report.loss is not None else float("nan")
        scale = f", loss scale {report.loss_scale:g}" if report.loss_scale is not None else ""
        if breakdown:
            self.logger.info("step %d: %s", report.global_step, breakdown)
        self.logger.info(
            "step %d: loss %.4f, lr %s, grad norm %.4g%s, %.1f samples/s",
            report.global_step,
            loss,
            ", ".join(f"{lr:.3g}" for lr in report.lr),
            report.grad_norm or 0.0,
            scale,
            rate,
        )
