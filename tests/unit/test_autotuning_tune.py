"""The whole tune (autotuning/tune.py) with a fake experiment runner: profile, pruning, tuner order, refits,
results. No processes: the runner is replaced by a function that answers like the engine would."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardspeed.autotuning.memory import ModelProfile, states_for
from shardspeed.autotuning.runner import Experiment, ExperimentResult
from shardspeed.autotuning.space import Point
from shardspeed.autotuning.tune import TuneError, TuneRequest, script_args_for, tune

PARAMS = 200_000
ACT_PER_SAMPLE = 1e6
TRUE_SCALE, TRUE_OFFSET = 1.3, 3e8


def _config(tmp: Path, **tuning: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0, 1, 2]},
        "autotuning": {
            "enabled": True,
            "results_dir": str(tmp / "results"),
            "exps_dir": str(tmp / "exps"),
            "max_train_micro_batch_size_per_gpu": 64,
            "num_tuning_micro_batch_sizes": 4,
            "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"},
            **tuning,
        },
    }


class FakeRunner:
    """Answers like a trial: throughput peaks at micro-batch 16, stage 1; memory = offset + states + 1.3 × act."""

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.calls: list[Experiment] = []
        self.fail = fail

    def __call__(self, exp: Experiment) -> ExperimentResult:
        self.calls.append(exp)
        exp.exp_dir.mkdir(parents=True, exist_ok=True)
        config = exp.ds_config
        mb = config["train_micro_batch_size_per_gpu"]
        if config["autotuning"].get("model_info"):
            info = {"trainable_num_params": PARAMS, "activation_bytes": ACT_PER_SAMPLE * mb, "micro_batch": mb}
            info["host_peak_bytes"] = int(TRUE_OFFSET + 16 * PARAMS + TRUE_SCALE * ACT_PER_SAMPLE * mb)
            Path(config["autotuning"]["model_info_path"]).write_text(json.dumps(info))
            return ExperimentResult(exp.name, "ok", None, {}, 0.1, None, exp.exp_dir / "log.txt")
        if exp.name in self.fail:
            return ExperimentResult(exp.name, "failed", None, {}, 0.1, "exit status 1: boom", exp.exp_dir / "log.txt")
        point = Point(config["zero_optimization"]["stage"], mb, config["gradient_accumulation_steps"])
        states = states_for(point, ModelProfile(PARAMS, ACT_PER_SAMPLE), exp.num_procs, "fp32", 8)
        measured = TRUE_OFFSET + states.total() + states.cpu + TRUE_SCALE * ACT_PER_SAMPLE * mb
        value = 100.0 - 8.0 * (math.log2(mb) - 4) ** 2 - 6.0 * abs(point.stage - 1)
        accounted = states.total() + TRUE_SCALE * ACT_PER_SAMPLE * mb  # the model's part, as the probe measures it
        metrics = {"throughput": value, "max_host_peak_bytes": measured, "max_accounted_bytes": accounted}
        return ExperimentResult(exp.name, "ok", value, metrics, 0.1, None, exp.exp_dir / "log.txt")


def test_a_tune_profiles_prunes_runs_and_writes_deepspeeds_files(tmp_path: Path) -> None:
    runner = FakeRunner(fail={"z2_mb8_gas1"})
    request = TuneRequest(
        _config(tmp_path, tuner_type="gridsearch", tuner_early_stopping=50),
        "train.py",
        ["--deepspeed_config", "cfg.json"],
        2,
        device_memory_gb=0.03,  # a simulated device: ~30 MB holds the model states + up to ~25 samples
        plot=False,
    )
    report = tune(request, run=runner)
    profile, second, *trials = runner.calls
    assert profile.num_procs == 1 and profile.ds_config["train_micro_batch_size_per_gpu"] == 1
    # [Note: two-point profile]: (30 MB - 3.2 MB of states) / 2 leaves room for 13 samples: micro-batch 8
    assert second.num_procs == 1 and second.ds_config["train_micro_batch_size_per_gpu"] == 8
    assert all(t.num_procs == 2 for t in trials)
    statuses = {r.name: r.status for r in report.rows}
    assert statuses["z0_mb32_gas1"] == "pruned" and statuses["z0_mb64_gas1"] == "pruned"
    assert statuses["z2_mb8_gas1"] == "failed"  # recorded, never fatal
    assert report.pruned >= 3 and all(not t.name.endswith(("mb32_gas1", "mb64_gas1")) for t in trials)
    assert report.best is not None and report.best.name == "z1_mb16_gas1"
    # the correction converges to the truth, and the fitted prediction of every trial is within 1%
    assert report.correction.scale == pytest.approx(TRUE_SCALE, rel=1e-6)
    assert report.correction.offset == pytest.approx(TRUE_OFFSET, rel=1e-6)
    ran = [r for r in report.rows if r.status == "ok"]
    assert ran and all(abs(r.prediction_error(fitted=True)) < 0.01 for r in ran)
    # ... and so is every prediction made before its trial ran: the two profiles gave the scale
    assert all(abs(r.prediction_error()) < 0.01 for r in ran)
    results = tmp_path / "results"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 16 and "autotuning" not in optimal
    command = (results / "cmd_optimal.txt").read_text().split()
    assert command[command.index("--deepspeed_config") + 1] == str(results / "ds_config_optimal.json")
    assert command[command.index("--batch") + 1] == "16"
    # the model's own part (no runtime offset): the raw activation term under-predicts by 1 - 1/1.3 at most
    for row in ran:
        assert row.accounted_bytes is not None and -0.231 < row.accounted_error() < 0
        assert row.accounted_error() == pytest.approx(
            (row.predicted_accounted_bytes - row.accounted_bytes) / row.accounted_bytes
        )
    summary = (results / "summary.txt").read_text()
    assert "model err" in summary
    assert "pruned without running" in summary and "activation correction: scale 1.300" in summary
    assert "activation scale 1.300 from profiles at micro-batch 1 and 8" in summary
    assert sum(1 for _ in (results / "trials.jsonl").open()) == len(report.rows)


def test_model_based_reaches_the_grid_best_in_fewer_trials(tmp_path: Path) -> None:
    grid = tune(
        TuneRequest(_config(tmp_path / "g", tuner_early_stopping=50), "t.py", [], 2, plot=False), run=FakeRunner()
    )
    model = tune(
        TuneRequest(
            _config(tmp_path / "m", tuner_type="model_based", tuner_early_stopping=3), "t.py", [], 2, plot=False
        ),
        run=FakeRunner(),
    )
    assert model.best is not None and grid.best is not None
    assert model.best.metric >= 0.95 * grid.best.metric and model.trials_run < grid.trials_run


def test_nothing_fits_is_a_clear_error(tmp_path: Path) -> None:
    request = TuneRequest(_config(tmp_path), "t.py", [], 2, device_memory_gb=1e-6)
    with pytest.raises(TuneError, match="pruned by the memory budgets"):
        tune(request, run=FakeRunner())


def test_a_failed_profile_run_is_a_clear_error(tmp_path: Path) -> None:
    def broken(exp: Experiment) -> ExperimentResult:
        return ExperimentResult(exp.name, "failed", None, {}, 0.1, "exit status 1: ImportError", exp.exp_dir / "log")

    with pytest.raises(TuneError, match=r"profile run .* failed: failed: exit status 1: ImportError"):
        tune(TuneRequest(_config(tmp_path), "t.py", [], 2), run=broken)


def test_arg_mappings_put_config_values_on_the_script_command_line() -> None:
    point = Point(1, 8, 2, checkpoint_activations=True)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}
    mappings = {
        "train_micro_batch_size_per_gpu": "--bs",
        "gradient_accumulation_steps ": "--gas",
        "activation_checkpointing": "--ac",
    }
    assert script_args_for(["--bs", "1", "--x"], config, point, mappings) == ["--bs", "8", "--x", "--gas", "2", "--ac"]


def test_a_failed_second_profile_keeps_scale_one_and_the_tune_goes_on(tmp_path: Path) -> None:
    runner = FakeRunner(fail={"profile_mb8"})
    inner = runner.__call__

    def run(exp: Experiment) -> ExperimentResult:
        if exp.name == "profile_mb8":
            runner.calls.append(exp)
            return ExperimentResult(exp.name, "failed", None, {}, 0.1, "exit status 1: OOM", exp.exp_dir / "log")
        return inner(exp)

    request = TuneRequest(_config(tmp_path, tuner_type="gridsearch"), "t.py", [], 2, device_memory_gb=0.03, plot=False)
    report = tune(request, run=run)
    assert report.best is not None and report.best.name == "z1_mb16_gas1"
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "activation scale 1 (one profile only)" in summary
