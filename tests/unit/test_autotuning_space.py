"""The tuning space (autotuning/space.py): lists and "auto" expand, batch rules, strict validation. No processes."""

from __future__ import annotations

import pytest

from shardspeed.autotuning.space import (
    Point,
    SpaceError,
    expand,
    materialize,
    micro_batch_ladder,
    thin_micro_batches,
    validate,
)
from shardspeed.config.autotuning import AutotuningConfig

ADAM = {"type": "Adam", "params": {"lr": 1e-3}}


def _user(**kw: object) -> dict:
    return {"optimizer": ADAM, **kw}


def test_micro_batch_ladder_is_powers_of_two_and_both_ends() -> None:
    assert micro_batch_ladder(1, 16) == [1, 2, 4, 8, 16]
    assert micro_batch_ladder(3, 20) == [3, 4, 8, 16, 20]


def test_thin_keeps_the_largest_and_spreads() -> None:
    assert thin_micro_batches([1, 2, 4, 8, 16], 3) == [1, 4, 16]
    assert thin_micro_batches([1, 2, 4, 8, 16], 1) == [16]
    assert thin_micro_batches([2, 8], 3) == [2, 8]


def test_auto_stage_and_micro_batch_expand_to_the_grid() -> None:
    tuning = AutotuningConfig(max_train_micro_batch_size_per_gpu=8)
    space = expand(_user(train_micro_batch_size_per_gpu="auto", zero_optimization={"stage": "auto"}), tuning, 2)
    assert {(p.stage, p.micro_batch) for p in space.points} == {(s, m) for s in range(4) for m in (1, 2, 4, 8)}
    assert not space.invalid


def test_lists_are_the_values_tried_and_scalars_are_fixed() -> None:
    user = _user(
        train_micro_batch_size_per_gpu=[2, 6],
        gradient_accumulation_steps=[1, 2],
        zero_optimization={"stage": 2, "overlap_comm": [True, False], "reduce_bucket_size": [1e6, 5e7]},
    )
    space = expand(user, AutotuningConfig(), 2)
    assert len(space.points) == 2 * 2 * 2 * 2
    assert {p.stage for p in space.points} == {2}
    assert {p.reduce_bucket_size for p in space.points} == {1_000_000, 50_000_000}


def test_fast_false_adds_deepspeeds_bucket_lists_and_cpu_offload() -> None:
    user = _user(train_micro_batch_size_per_gpu=4, zero_optimization={"stage": [2, 3]})
    fast = expand(user, AutotuningConfig(), 2).points
    full = expand(user, AutotuningConfig(fast=False), 2).points
    assert len(fast) == 2 and len(full) > len(fast)
    assert {p.offload_optimizer for p in full} == {"none", "cpu"}
    assert {p.offload_param for p in full if p.stage == 3} == {"none", "cpu"}
    assert all(p.offload_param == "none" for p in full if p.stage == 2)


def test_offload_auto_and_nvme_only_with_a_path() -> None:
    user = _user(
        train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 2, "offload_optimizer": {"device": "auto"}}
    )
    assert {p.offload_optimizer for p in expand(user, AutotuningConfig(), 1).points} == {"none", "cpu"}
    user["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/tmp/nvme"
    assert "nvme" in {p.offload_optimizer for p in expand(user, AutotuningConfig(), 1).points}


def test_fixed_train_batch_size_decides_gas_and_bad_splits_are_invalid() -> None:
    user = _user(train_batch_size=32, train_micro_batch_size_per_gpu=[2, 4, 3], zero_optimization={"stage": 1})
    space = expand(user, AutotuningConfig(), 2)
    assert {(p.micro_batch, p.gas) for p in space.points} == {(2, 8), (4, 4)}
    assert [name for name, _ in space.invalid] == ["z1_mb3_gas5"]


def test_batch_bounds_make_points_invalid() -> None:
    tuning = AutotuningConfig(max_train_batch_size=8, min_train_batch_size=4)
    space = expand(_user(train_micro_batch_size_per_gpu=[1, 2, 4, 8], zero_optimization={"stage": 0}), tuning, 2)
    assert {p.micro_batch for p in space.points} == {2, 4}
    assert any("max_train_batch_size" in why for _, why in space.invalid)


def test_activation_checkpointing_is_tried_both_ways_when_mapped() -> None:
    tuning = AutotuningConfig(arg_mappings={"activation_checkpointing": "--checkpoint_activations"})
    space = expand(_user(train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 1}), tuning, 2)
    assert {p.checkpoint_activations for p in space.points} == {False, True}


def test_materialized_configs_validate_and_carry_the_point() -> None:
    point = Point(3, 8, 2, offload_optimizer="cpu", offload_param="cpu", overlap_comm=False)
    user = _user(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", zero_optimization={"stage": "auto"})
    config = materialize(user, point, 2)
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_accumulation_steps"] == 2
    assert "train_batch_size" not in config
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and zero["overlap_comm"] is False
    assert validate(config, 2) == ""
    assert user["zero_optimization"]["stage"] == "auto"  # the user's dict is untouched


def test_a_point_the_strict_config_refuses_is_invalid_with_its_reason() -> None:
    # a typo inside a section the tuner copies through: every point is refused, naming the key
    user = _user(train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 1, "reduce_bucket_sise": 5})
    space = expand(user, AutotuningConfig(), 2)
    assert not space.points and "reduce_bucket_sise" in space.invalid[0][1]


def test_an_empty_list_is_a_clear_error() -> None:
    with pytest.raises(SpaceError, match="train_micro_batch_size_per_gpu"):
        expand(_user(train_micro_batch_size_per_gpu=[]), AutotuningConfig(), 2)


def test_the_autotuning_section_keeps_deepspeeds_defaults_and_checks_the_window() -> None:
    tuning = AutotuningConfig()
    assert (tuning.fast, tuning.start_profile_step, tuning.end_profile_step, tuning.tuner_num_trials) == (
        True,
        3,
        5,
        50,
    )
    assert (tuning.results_dir, tuning.exps_dir, tuning.metric, tuning.tuner_type) == (
        "autotuning_results",
        "autotuning_exps",
        "throughput",
        "gridsearch",
    )
    with pytest.raises(ValueError, match="end_profile_step"):
        AutotuningConfig(start_profile_step=5, end_profile_step=5)
