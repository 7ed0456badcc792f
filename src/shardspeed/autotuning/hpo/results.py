"""The study's files in the results directory: the best trial, a table of trials, Optuna's plots.

``best_trial.json`` (number, value, params, the config and command to train with them), ``best_config.json``
(that config, ready for ``--deepspeed_config``), ``cmd_best.txt``, ``trials.csv`` (one row per trial) and
``summary.txt`` (finished trials ranked, best first), ``optimization_history.png`` and
``param_importances.png`` (Optuna's matplotlib backend; a plot Optuna cannot draw yet — e.g. importances with
fewer than two finished trials — is skipped with the reason in ``plots.txt``).
"""

from __future__ import annotations

import csv
import json
import math
import shlex
from pathlib import Path
from typing import Any

import optuna

from shardspeed.autotuning.hpo.study import HpoJob, quiet_optuna, trial_config
from shardspeed.autotuning.hpo.substitute import apply_to_args, split_config_arg

TRAIN_CONFIG = "best_config.json"


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return study.best_trial if complete else None


def train_config(job: HpoJob, params: dict[str, Any]) -> dict[str, Any]:
    """The config to train with: the trial's values, without the trial's early-stop ``autotuning`` section."""
    config = trial_config(job, params)
    original = job.ds_config.get("autotuning")
    if original is None:
        config.pop("autotuning", None)
    else:
        config["autotuning"] = original
    return config


def train_command(job: HpoJob, params: dict[str, Any], config_path: Path) -> str:
    words = ["shardspeed", *job.launcher_args, "--num_procs", str(job.num_procs), job.script]
    _, args = split_config_arg(job.script_args)
    words += [*apply_to_args(args, params), "--deepspeed_config", str(config_path)]
    return shlex.join(words)


def _row(trial: optuna.trial.FrozenTrial, names: list[str]) -> dict[str, Any]:
    last_step = max(trial.intermediate_values) if trial.intermediate_values else ""
    row: dict[str, Any] = {
        "number": trial.number,
        "state": trial.state.name,
        "value": "" if trial.value is None else trial.value,
        "steps_reported": len(trial.intermediate_values),
        "last_step": last_step,
        "wall_s": trial.user_attrs.get("wall_s", ""),
        "stopped": trial.user_attrs.get("stopped", ""),
        "error": trial.user_attrs.get("error", ""),
    }
    for name in names:
        row[name] = trial.params.get(name, "")
    return row


def write_table(study: optuna.Study, job: HpoJob, out: Path) -> list[dict[str, Any]]:
    names = list(job.space.params)
    rows = [_row(t, names) for t in study.get_trials(deepcopy=False)]
    columns = ["number", "state", "value", *names, "steps_reported", "last_step", "wall_s", "stopped", "error"]
    with (out / "trials.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    sign = -1.0 if job.space.study.direction == "maximize" else 1.0
    ranked = sorted((r for r in rows if r["state"] == "COMPLETE"), key=lambda r: sign * float(r["value"])) + [
        r for r in rows if r["state"] != "COMPLETE"
    ]
    widths = {c: max(len(c), *(len(_cell(r[c])) for r in ranked)) if ranked else len(c) for c in columns[:-1]}
    lines = [
        f"study {study.study_name!r}: {len(rows)} trials ({_counts(rows)}), "
        f"{job.space.study.direction} {job.space.study.metric}",
        "  ".join(c.ljust(widths[c]) for c in columns[:-1]),
    ]
    lines += ["  ".join(_cell(r[c]).ljust(widths[c]) for c in columns[:-1]) for r in ranked]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    return str(value)


def _counts(rows: list[dict[str, Any]]) -> str:
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    return ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items()))


def write_best(study: optuna.Study, job: HpoJob, out: Path) -> dict[str, Any] | None:
    best = best_trial(study)
    if best is None:
        return None
    config_path = (out / TRAIN_CONFIG).resolve()
    config = train_config(job, dict(best.params))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    command = train_command(job, dict(best.params), config_path)
    (out / "cmd_best.txt").write_text(command + "\n")
    record = {
        "number": best.number,
        "value": best.value,
        "metric": job.space.study.metric,
        "direction": job.space.study.direction,
        "params": best.params,
        "config": config,
        "command": command,
    }
    (out / "best_trial.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def write_plots(study: optuna.Study, out: Path) -> dict[str, str]:
    """Optuna's matplotlib plots as PNG; returns {file: "written" | why not}."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization import matplotlib as optuna_plots

    outcome: dict[str, str] = {}
    for file, draw in (
        ("optimization_history.png", optuna_plots.plot_optimization_history),
        ("param_importances.png", optuna_plots.plot_param_importances),
    ):
        try:
            with quiet_optuna():
                axes = draw(study)
            figure = axes.figure
            figure.savefig(out / file, dpi=100, bbox_inches="tight")
            import matplotlib.pyplot as plt  # Optuna's backend draws on pyplot figures; free them

            plt.close(figure)
            outcome[file] = "written"
        except (ValueError, RuntimeError, ZeroDivisionError) as error:
            outcome[file] = f"skipped: {error}"
    (out / "plots.txt").write_text("".join(f"{f}: {why}\n" for f, why in outcome.items()))
    return outcome


def write_results(study: optuna.Study, job: HpoJob, plots: bool = True) -> dict[str, Any]:
    out = job.results_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = write_table(study, job, out)
    best = write_best(study, job, out)
    plot_outcome = write_plots(study, out) if plots else {}
    return {"trials": len(rows), "best": best, "plots": plot_outcome}
