"""The whole tune: profile one micro-batch, expand the space, prune by the memory model, run trials in the tuner's
order through the experiment runner, refit the memory correction, write the results.

``shardspeed --autotuning tune ...`` calls ``tune``; ``--autotuning run`` then launches the script with
``ds_config_optimal.json`` (``cmd_optimal.txt``'s command). The flow, and where we differ from DeepSpeed:
1. Profile runs (profile_run.py): one process, ZeRO 0, micro-batch 1, the engine's ``model_info.profile``
   (autotuning/probe.py): the parameter count and the saved-tensor bytes of one micro-batch (once more with the
   script's activation checkpointing when ``arg_mappings`` maps it), and once at a larger micro-batch for the
   activation scale and the runtime's offset ([Note: two-point profile]). DeepSpeed also profiles first, but then
   learns memory from trials; we predict every point from the model-state model (zero/memory.py) + these bytes.
2. Space (space.py), every point validated by the strict config; the memory model prunes every point that cannot
   fit the device budget (real, or ``--device_memory_gb`` on CPU) or the host budget — before anything runs.
3. ``num_tuning_micro_batch_sizes`` micro-batches per group of otherwise equal points, spread over the feasible.
4. Trials (runner.py) in the tuner's order (tuners.py) until ``tuner_num_trials`` / ``tuner_early_stopping``; after
   each, the activation scale/offset is refitted (memory.py) and untried points that no longer fit are pruned.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from shardspeed.autotuning.args import script_args_for
from shardspeed.autotuning.memory import Budgets, Correction, Prediction, fit_correction, predict, prune
from shardspeed.autotuning.profile_run import ProfileError, profile_model
from shardspeed.autotuning.results import ProgressBar, TrialRow, rank_rows, write_results
from shardspeed.autotuning.runner import Experiment, ExperimentResult, run_experiment, with_config_arg
from shardspeed.autotuning.space import Point, expand, materialize, thin_micro_batches
from shardspeed.autotuning.tuners import build_tuner, score
from shardspeed.config.autotuning import AutotuningConfig
from shardspeed.config.errors import ConfigError
from shardspeed.config.load import load_config, read_config_source
from shardspeed.precision.policy import memory_precision

__all__ = ["TuneError", "TuneReport", "TuneRequest", "tune"]

GB = 1e9
Runner = Callable[[Experiment], ExperimentResult]


class TuneError(RuntimeError):
    """The tune cannot go on (a bad autotuning section, a profile run that failed, nothing fits)."""


@dataclass
class TuneRequest:
    config: str | dict[str, Any]
    script: str
    script_args: list[str]
    num_procs: int
    device_memory_gb: float | None = None
    host_memory_gb: float | None = None
    launcher_args: list[str] = field(default_factory=list)
    seed: int = 0
    plot: bool = True
    """Write metric_vs_micro_batch.png (needs matplotlib)."""


@dataclass
class TuneReport:
    rows: list[TrialRow]
    best: TrialRow | None
    correction: Correction
    results_dir: Path
    wall_s: float
    trials_run: int
    pruned: int
    stop_reason: str
    command: list[str]


def _section(user: dict[str, Any]) -> AutotuningConfig:
    try:
        return AutotuningConfig.model_validate(user.get("autotuning") or {})
    except ValueError as error:
        raise TuneError(f"the config's autotuning section: {error}") from None


def _budgets(request: TuneRequest, tuning: AutotuningConfig) -> Budgets:
    import torch

    on_cpu = not torch.cuda.is_available()
    device_gb = request.device_memory_gb or tuning.device_memory_gb
    device = int(device_gb * GB) if device_gb else None
    if device is None and not on_cpu:
        device = int(torch.cuda.get_device_properties(0).total_memory)
    host_gb = request.host_memory_gb or tuning.host_memory_gb
    host = int(host_gb * GB) if host_gb else int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Budgets(device, host, ranks_per_node=request.num_procs, on_cpu=on_cpu)


def _precision(config: dict[str, Any], world: int) -> tuple[str, int | None]:
    typed = load_config(config, dp_world_size=world)
    optimizer = typed.optimizer.type.lower() if typed.optimizer else "adam"
    states = 0 if optimizer == "sgd" else 8  # Adam-like: momentum + variance (fp32)
    master = typed.master_dtype.itemsize
    states = states * master // 4 + (master if typed.compute_dtype != typed.master_dtype else 0)
    return memory_precision(typed), states


def tune(request: TuneRequest, *, run: Runner = run_experiment, stream: TextIO | None = None) -> TuneReport:
    """Run a whole tune (module docstring); returns the report and writes results_dir."""
    started = time.perf_counter()
    stream = stream or sys.stderr
    try:
        user = read_config_source(request.config)
    except (ConfigError, OSError, ValueError) as error:
        raise TuneError(f"cannot read the config: {error}") from None
    tuning = _section(user)
    results_dir, exps = Path(tuning.results_dir), Path(tuning.exps_dir)
    space = expand(user, tuning, request.num_procs)
    if not space.points:
        raise TuneError(f"no valid point in the tuning space ({len(space.invalid)} refused: {space.invalid[:3]})")
    budgets = _budgets(request, tuning)
    dp = max(1, request.num_procs // tuning.mp_size)
    precision, opt_bytes = _precision(materialize(user, space.points[0], dp), dp)
    try:
        profile, correction, profile_note = profile_model(
            script=request.script,
            script_args=request.script_args,
            launcher_args=request.launcher_args,
            user=user,
            tuning=tuning,
            exps=exps,
            run=run,
            budgets=budgets,
            precision=precision,
            opt_bytes=opt_bytes,
        )
    except ProfileError as error:
        raise TuneError(str(error)) from None

    def predictions(points: Sequence[Point]) -> list[Prediction]:
        return [
            predict(
                p, profile, dp, correction, on_cpu=budgets.on_cpu, precision=precision, optimizer_state_bytes=opt_bytes
            )
            for p in points
        ]

    rows: dict[Point, TrialRow] = {}
    invalid_rows = [TrialRow(name, {}, "invalid", error=why) for name, why in space.invalid]
    points = list(space.points)
    before = predictions(points)
    kept, pruned = prune(points, before, budgets)
    for index, why in pruned:
        rows[points[index]] = _row(points[index], "pruned", before[index], why)
    feasible = [points[i] for i in kept]
    candidates = _thin(feasible, tuning.num_tuning_micro_batch_sizes)
    for point in feasible:
        if point not in candidates:
            rows[point] = TrialRow(point.name, point.as_dict(), "skipped", error="num_tuning_micro_batch_sizes")
    if not candidates:
        raise TuneError(f"every one of {len(points)} points is pruned by the memory budgets (e.g. {pruned[0][1]})")
    tuner = build_tuner(
        tuning.tuner_type, candidates, tuning.metric, tuning.tuner_early_stopping, tuning.tuner_num_trials, request.seed
    )
    bar = ProgressBar(min(len(candidates), tuning.tuner_num_trials), stream)
    samples: list[tuple[float, float, float]] = []
    print(
        f"[autotuning] {len(points)} points: {len(pruned)} pruned by the memory model, {len(space.invalid)} invalid, "
        f"{len(candidates)} candidates ({tuning.tuner_type})",
        file=stream,
        flush=True,
    )
    while (point := tuner.next()) is not None:
        prediction = predictions([point])[0]
        config = materialize(user, point, dp)
        if tuning.metric == "flops":
            config["flops_profiler"] = {  # the step before the window: profiling overhead stays out of it
                "enabled": True,
                "profile_step": max(tuning.start_profile_step - 1, 1),
                "detailed": False,
            }
        exp_dir = exps / point.name
        result = _cached(exp_dir) if not tuning.overwrite else None
        if result is None:
            args = script_args_for(request.script_args, config, point, tuning.arg_mappings)
            result = run(
                Experiment(
                    point.name,
                    request.script,
                    args,
                    config,
                    request.num_procs,
                    exp_dir,
                    tuning.trial_timeout_s,
                    launcher_args=request.launcher_args,
                )
            )
        tuner.record(point, result.metric)
        row = _row(point, result.status, prediction, result.error)
        row.metric, row.score, row.wall_s = result.metric, score(result.metric, tuning.metric), result.wall_s
        row.config = _optimal_config(config)
        if result.status == "ok":
            measured = result.metrics.get("max_device_peak_bytes") or result.metrics.get("max_host_peak_bytes")
            row.measured_bytes = float(measured) if measured else None
            row.accounted_bytes = result.metrics.get("max_accounted_bytes")  # probe.py [Note: accounted memory]
            if row.measured_bytes:
                states = prediction.states.total() + (prediction.states.cpu if budgets.on_cpu else 0)
                samples.append(
                    (states, prediction.activation_bytes, row.measured_bytes, bool(point.checkpoint_activations))
                )
                correction = fit_correction(samples, correction)
                _reprune(tuner, predictions, budgets, rows)
        rows[point] = row
        ranked = rank_rows(list(rows.values()))
        bar.update(row, ranked[0].name if ranked else None)
    for row in rows.values():  # the final fit, for every trial that ran
        if row.status == "ok":
            row.fitted_bytes = predictions([Point(**row.point)])[0].measured_equivalent
    all_rows = invalid_rows + list(rows.values())
    best_point = rank_rows(all_rows)
    command = optimal_command(request, tuning, best_point[0] if best_point else None, results_dir)
    n_pruned = sum(r.status == "pruned" for r in all_rows)
    notes = [
        f"pruned without running: {n_pruned} (memory model); invalid: {len(invalid_rows)}",
        f"budgets: device {_gb(budgets.device_bytes)} per rank{' (simulated)' if budgets.on_cpu else ''}, "
        f"host {_gb(budgets.host_bytes)} per node",
        f"activation correction: scale {correction.scale:.3f}"
        + (f" ({correction.checkpointed_scale:.3f} checkpointed)" if correction.checkpointed_scale is not None else "")
        + f", offset {correction.offset / 1e6:.1f} MB "
        f"(fitted on {correction.trials} trials; before any trial: {profile_note})",
        f"profile: {profile.num_params} parameters, {profile.activation_bytes_per_sample / 1e6:.3f} MB saved "
        f"activations per sample"
        + (
            f" ({profile.checkpointed_bytes_per_sample / 1e6:.3f} MB checkpointed)"
            if profile.checkpointed_bytes_per_sample
            else ""
        ),
        f"stopped: {tuner.stop_reason}",
    ]
    best = write_results(results_dir, all_rows, tuning.metric, command=command, notes=notes, plot=request.plot)
    return TuneReport(
        all_rows,
        best,
        correction,
        results_dir,
        time.perf_counter() - started,
        len(tuner.tried),
        n_pruned,
        tuner.stop_reason,
        command,
    )


def _gb(value: int | None) -> str:
    return "unlimited" if value is None else f"{value / GB:.3g} GB"


def _row(point: Point, status: str, prediction: Prediction, error: str | None) -> TrialRow:
    return TrialRow(
        point.name,
        point.as_dict(),
        status,
        predicted_bytes=prediction.measured_equivalent,
        predicted_device_bytes=prediction.device_bytes,
        predicted_accounted_bytes=prediction.states.total() + prediction.states.cpu + prediction.activation_bytes,
        error=error,
    )


def _thin(points: Sequence[Point], count: int) -> list[Point]:
    """Step 3: per group of points equal but for the micro-batch, ``count`` micro-batches (space.py)."""
    groups: dict[tuple[Any, ...], list[Point]] = {}
    for p in points:
        groups.setdefault(
            (
                p.stage,
                p.gas,
                p.offload_optimizer,
                p.offload_param,
                p.reduce_bucket_size,
                p.allgather_bucket_size,
                p.overlap_comm,
                p.checkpoint_activations,
            ),
            [],
        ).append(p)
    keep = set()
    for group in groups.values():
        chosen = set(thin_micro_batches([p.micro_batch for p in group], count))
        keep |= {p for p in group if p.micro_batch in chosen}
    return [p for p in points if p in keep]


def _reprune(
    tuner: Any,
    predictions: Callable[[Sequence[Point]], list[Prediction]],
    budgets: Budgets,
    rows: dict[Point, TrialRow],
) -> None:
    """After a refit: untried candidates that no longer fit are pruned (step 4)."""
    done = {p for p, _ in tuner.tried}
    untried = [p for p in tuner.points if p not in done]
    after = predictions(untried)
    _, pruned = prune(untried, after, budgets)
    gone = set()
    for index, why in pruned:
        rows[untried[index]] = _row(untried[index], "pruned", after[index], why + " (after the refit)")
        gone.add(untried[index])
    if gone:
        tuner.points = [p for p in tuner.points if p not in gone]


def _cached(exp_dir: Path) -> ExperimentResult | None:
    """``overwrite: false``: a trial whose result exists is not run again."""
    try:
        data = json.loads((exp_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    data["log_path"] = Path(data["log_path"])
    return ExperimentResult(**data)


def _optimal_config(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's config as the user trains with it: without the autotuning section (its engine would exit)."""
    out = json.loads(json.dumps(config))
    out.pop("autotuning", None)
    return out


def optimal_command(
    request: TuneRequest, tuning: AutotuningConfig, best: TrialRow | None, results_dir: Path
) -> list[str]:
    """``cmd_optimal.txt``: the launch that trains with ds_config_optimal.json."""
    path = results_dir / "ds_config_optimal.json"
    args = list(request.script_args)
    if best is not None:
        args = script_args_for(args, best.config, Point(**best.point), tuning.arg_mappings)
    return [
        "shardspeed",
        "--num_procs",
        str(request.num_procs),
        *request.launcher_args,
        request.script,
        *with_config_arg(args, path),
    ]


def describe(report: TuneReport) -> str:
    best = report.best
    return (
        f"[autotuning] {report.trials_run} trials, {report.pruned} points pruned, {report.wall_s:.0f} s; "
        + (f"best {best.name} ({best.metric:.4g}); " if best else "no trial succeeded; ")
        + f"results in {report.results_dir}: {shlex.join(report.command)}"
    )
