"""The HPO search-space file: parsing, defaults, and errors that name the bad entry (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from shardspeed.autotuning.hpo.space import SpaceError, load_space, parse_space


def test_parses_every_distribution_and_the_study_settings(tmp_path: Path) -> None:
    raw = {
        "study": {"direction": "maximize", "metric": "samples_per_sec", "n_trials": 7, "seed": 3, "pruner": "none"},
        "params": {
            "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
            "warmup_steps": {"type": "int", "low": 0, "high": 20, "step": 5},
            "zero_optimization.stage": {"type": "categorical", "choices": [1, 2]},
            "--dropout": {"type": "float", "low": 0.0, "high": 0.3},
        },
    }
    path = tmp_path / "space.json"
    path.write_text(json.dumps(raw))
    space = load_space(path)
    assert space.study.direction == "maximize" and space.study.n_trials == 7 and space.study.seed == 3
    assert space.study.sampler == "tpe" and space.study.steps_per_trial == 50  # defaults
    assert space.params["lr"].log and space.params["warmup_steps"].step == 5
    assert space.params["zero_optimization.stage"].choices == [1, 2]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"lr": {"type": "float", "low": 1.0, "high": 0.1}}, "params.lr: low (1) must be <= high (0.1)"),
        ({"lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}, "params.lr: log needs low > 0"),
        ({"lr": {"type": "float", "low": 0.1, "high": 1.0, "log": True, "step": 0.1}}, "log and step"),
        ({"lr": {"type": "float", "high": 1.0}}, "params.lr: float needs 'low' and 'high'"),
        ({"stage": {"type": "categorical", "choices": []}}, "params.stage: categorical needs a non-empty"),
        ({"n": {"type": "int", "low": 0.5, "high": 3}}, "params.n: int needs integral low"),
        ({"lr": {"type": "uniform", "low": 0, "high": 1}}, "params.lr.type"),
        ({"lr": {"type": "float", "low": 0, "high": 1, "scale": "log"}}, "params.lr.scale"),
        ({"optimizer..lr": {"type": "float", "low": 0, "high": 1}}, "params['optimizer..lr']: not a script argument"),
        ({"--drop out": {"type": "float", "low": 0, "high": 1}}, "a script argument is written '--name'"),
        ({}, "'params' is empty"),
    ],
)
def test_errors_name_the_entry(params: dict, needle: str) -> None:
    with pytest.raises(SpaceError) as caught:
        parse_space({"params": params}, "space.json")
    assert needle in str(caught.value) and str(caught.value).startswith("space.json: ")


def test_study_errors_name_the_setting() -> None:
    good = {"lr": {"type": "float", "low": 0.1, "high": 1.0}}
    with pytest.raises(SpaceError, match=r"study\.direction"):
        parse_space({"study": {"direction": "up"}, "params": good})
    with pytest.raises(SpaceError, match=r"study\.n_trials"):
        parse_space({"study": {"n_trials": 0}, "params": good})
    with pytest.raises(SpaceError, match=r"study\.n_trails"):  # a misspelled setting is refused, not ignored
        parse_space({"study": {"n_trails": 3}, "params": good})
    with pytest.raises(SpaceError, match="lr_range_test needs a float parameter named 'lr'"):
        parse_space({"study": {"lr_range_test": {"enabled": True}}, "params": {"x": good["lr"]}})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SpaceError, match="No such file"):
        load_space(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{params: 1}")
    with pytest.raises(SpaceError, match="not valid JSON"):
        load_space(bad)
