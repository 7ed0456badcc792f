"""The LR range test as a quick first pass (``study.lr_range_test.enabled`` / ``shardspeed hpo --lr_range_test``).

One launch with DeepSpeed's ``LRRangeTest`` scheduler (``schedulers/range_test.py``): the lr grows linearly from
the ``lr`` parameter's ``low`` to its ``high`` over ``steps`` steps (``lr_range_test_step_size`` 1), the engine's
per-step losses are read as they come, and the pass stops at divergence (a loss above ``diverge_factor`` x the
lowest so far, or NaN/Inf). Smith's rule of thumb then narrows the study's lr range: the lr where the loss was
lowest is about the largest that still trains, so the study searches [lr_min_loss / ``span``, lr_min_loss]
(clipped to the original range). The narrowed range is stored in the study (``lr_bounds``) so resumed runs and
other workers search the same one. ``narrow_lr_range`` is the pure half.

The ramp is linear, as DeepSpeed defines it: with a range of several decades most steps are near ``high``, so the
pass locates the upper end (where training breaks down) well and the lower end not at all — hence ``span``.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from typing import Any

from shardspeed.autotuning.hpo.launch import RunFn, StopTrial, TrialLaunch
from shardspeed.autotuning.hpo.progress import record_value
from shardspeed.autotuning.hpo.space import LRRangeTestSettings
from shardspeed.autotuning.hpo.study import HpoJob
from shardspeed.autotuning.hpo.substitute import apply_to_args, apply_to_config
from shardspeed.schedulers.range_test import lr_range_test_lr_at

PASS_NAME = "lr_range_test"


def range_schedule(low: float, high: float, steps: int) -> dict[str, Any]:
    """``LRRangeTest`` params whose update at engine step s (1-based) uses low + (high - low)(s - 1)/(steps - 1)."""
    return {
        "lr_range_test_min_lr": low,
        "lr_range_test_step_size": 1,
        "lr_range_test_step_rate": (high / low - 1.0) / max(1, steps - 1),
        "lr_range_test_staircase": False,
    }


def lr_of_step(step: int, schedule: dict[str, Any]) -> float:
    """The lr of engine step ``step``'s update (the scheduler has stepped ``step - 1`` times before it)."""
    return lr_range_test_lr_at(
        step - 2,
        schedule["lr_range_test_min_lr"],
        schedule["lr_range_test_step_size"],
        schedule["lr_range_test_step_rate"],
        schedule["lr_range_test_staircase"],
    )


def narrow_lr_range(
    points: Sequence[tuple[float, float]], settings: LRRangeTestSettings, low: float, high: float
) -> tuple[float, float]:
    """[lr_min_loss / span, lr_min_loss] within [low, high], from (lr, loss) points in step order; the points
    after the first divergence are ignored. With no usable point the range stays as it was."""
    best_lr, best_loss = None, math.inf
    for lr, loss in points:
        if not math.isfinite(loss) or (best_lr is not None and loss > settings.diverge_factor * best_loss):
            break
        if loss < best_loss:
            best_lr, best_loss = lr, loss
    if best_lr is None:
        return low, high
    new_high = min(high, max(low, best_lr))
    new_low = max(low, new_high / settings.span)
    if new_low >= new_high:
        return low, high
    return new_low, new_high


class _Collect:
    """``on_progress`` of the pass: keeps (lr, loss) per step, stops the launch once the loss diverged."""

    def __init__(self, schedule: dict[str, Any], metric: str, settings: LRRangeTestSettings) -> None:
        self.schedule, self.metric, self.settings = schedule, metric, settings
        self.points: list[tuple[float, float]] = []
        self.best = math.inf
        self.diverged_at: int | None = None
        self._steps: set[int] = set()

    def __call__(self, record: dict[str, Any]) -> None:
        loss, step = record_value(record, self.metric), record.get("step")  # NaN: diverged (null with its key)
        if loss is None or not isinstance(step, int) or step in self._steps:
            return
        self._steps.add(step)
        lr = record.get("lr")
        lr = float(lr) if isinstance(lr, (int, float)) else lr_of_step(step, self.schedule)
        self.points.append((lr, float(loss)))
        if not math.isfinite(loss) or loss > self.settings.diverge_factor * self.best:
            self.diverged_at = step
            raise StopTrial(f"diverged at step {step} (lr {lr:.4g})")
        self.best = min(self.best, float(loss))


def run_range_test(job: HpoJob, run_fn: RunFn) -> tuple[float, float]:
    """Run the pass, write ``lr_range_test.json`` (and ``.png``), return the narrowed (low, high)."""
    settings = job.space.study.lr_range_test
    lr_param = job.space.params["lr"]
    low, high = float(lr_param.low or 0.0), float(lr_param.high or 0.0)
    schedule = range_schedule(low, high, settings.steps)
    # The pass's own scheduler replaces the user's (whose lr coupling does not apply: OneCycle would refuse lr).
    config = apply_to_config({k: v for k, v in job.ds_config.items() if k != "scheduler"}, {"lr": low})
    config["scheduler"] = {"type": "LRRangeTest", "params": schedule}
    config["autotuning"] = {"enabled": True, "start_profile_step": 1, "end_profile_step": settings.steps}
    exp_dir = (job.results_dir / "trials" / PASS_NAME).resolve()
    exp_dir.mkdir(parents=True, exist_ok=True)
    launch = TrialLaunch(
        name=PASS_NAME,
        script=job.script,
        script_args=apply_to_args(job.script_args, {}),
        ds_config=config,
        num_procs=job.num_procs,
        exp_dir=exp_dir,
        timeout_s=job.space.study.trial_timeout_s,
        env=dict(job.env),
        launcher_args=list(job.launcher_args),
    )
    collect = _Collect(schedule, job.space.study.metric, settings)
    status = "ok"
    with contextlib.suppress(StopTrial):  # a runner that lets the callback's exception through
        status = run_fn(launch, collect).status
    if collect.diverged_at is not None:  # we stopped it (the runner may call that "failed"): the expected end
        status = f"stopped: diverged at step {collect.diverged_at}"
    new_low, new_high = narrow_lr_range(collect.points, settings, low, high)
    points = [(lr, loss if math.isfinite(loss) else None) for lr, loss in collect.points]  # NaN is not JSON
    record = {"status": status, "original": [low, high], "narrowed": [new_low, new_high], "points": points}
    job.results_dir.mkdir(parents=True, exist_ok=True)
    (job.results_dir / f"{PASS_NAME}.json").write_text(json.dumps(record, indent=2) + "\n")
    _plot(collect.points, (new_low, new_high), job.results_dir / f"{PASS_NAME}.png")
    return new_low, new_high


def _plot(points: Sequence[tuple[float, float]], narrowed: tuple[float, float], path: Any) -> None:
    finite = [(lr, loss) for lr, loss in points if math.isfinite(loss)]
    if not finite:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([p[0] for p in finite], [p[1] for p in finite], marker=".")
    axes.axvspan(*narrowed, alpha=0.2, label="narrowed lr range")
    axes.set(xscale="log", yscale="log", xlabel="lr", ylabel="loss", title="LR range test")
    axes.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
