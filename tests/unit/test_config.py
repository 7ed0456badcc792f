"""Tests for shardspeed.config: parsing, inference, and the exact content of every error message.

Expected values are written out by hand from DeepSpeed's documented semantics, never read back from the
code under test.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import shardspeed.optim
import shardspeed.schedulers
from shardspeed.config import (
    IGNORED_KEYS,
    UNSUPPORTED_KEYS,
    ConfigError,
    ShardSpeedConfig,
    ZeroConfig,
    load_config,
)
from shardspeed.config import zero as zero_module

MICRO1 = {"train_micro_batch_size_per_gpu": 1}


def load(extra: dict[str, Any] | None = None, world: int = 1) -> ShardSpeedConfig:
    """A config with a micro batch of 1 plus ``extra``."""
    return load_config({**MICRO1, **(extra or {})}, dp_world_size=world)


def error_of(config: Any, world: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, dp_world_size=world)
    assert not isinstance(info.value, pydantic.ValidationError)
    return str(info.value)


@pytest.fixture
def fake_params_validators(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, dict, str]]:
    """Replace the optimizer/scheduler params validators by recorders that return the params unchanged."""
    calls: list[tuple[str, str, dict, str]] = []

    def recorder(section: str):
        def validate(type_name: str, params: dict, path: str = "") -> dict:
            calls.append((section, type_name, params, path))
            return dict(params)

        return validate

    monkeypatch.setattr(shardspeed.optim, "validate_optimizer_params", recorder("optimizer"))
    monkeypatch.setattr(shardspeed.schedulers, "validate_scheduler_params", recorder("scheduler"))
    return calls


# ---------------------------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        # (train_batch_size, micro, gas) given -> (train_batch_size, micro, gas) expected
        ((32, 4, None), 2, (32, 4, 4)),  # gas = 32 / (4 * 2)
        ((32, None, 2), 2, (32, 8, 2)),  # micro = 32 / (2 * 2)
        ((None, 4, 3), 2, (24, 4, 3)),  # tbs = 4 * 3 * 2
        ((32, None, None), 4, (32, 8, 1)),  # only tbs: gas = 1, micro = 32 / 4
        ((None, 5, None), 3, (15, 5, 1)),  # only micro: gas = 1, tbs = 5 * 3
        ((48, 4, 3), 4, (48, 4, 3)),  # all three, consistent
        ((None, 2, None), 1, (2, 2, 1)),
    ],
)
def test_batch_sizes_are_inferred(given: tuple, world: int, expected: tuple) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    config = {k: v for k, v in zip(keys, given) if v is not None}
    cfg = load_config(config, dp_world_size=world)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected
    assert cfg.dp_world_size == world


def test_inconsistent_batch_sizes_show_all_four_numbers() -> None:
    message = error_of(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        world=3,
    )
    assert "train_batch_size (32)" in message
    assert "train_micro_batch_size_per_gpu (4)" in message
    assert "gradient_accumulation_steps (2)" in message
    assert "data-parallel world size (3)" in message
    assert "= 24" in message


@pytest.mark.parametrize(
    ("config", "world", "fragments"),
    [
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            2,
            ["gradient_accumulation_steps", "30", "= 8"],
        ),
        (
            {"train_batch_size": 30, "gradient_accumulation_steps": 4},
            2,
            ["train_micro_batch_size_per_gpu", "= 8"],
        ),
        (
            {"train_batch_size": 10},
            4,
            ["train_micro_batch_size_per_gpu", "(10)", "data-parallel world size (4)"],
        ),
    ],
)
def test_batch_inference_requires_exact_division(config: dict, world: int, fragments: list[str]) -> None:
    message = error_of(config, world)
    assert message.startswith("cannot infer")
    for fragment in fragments:
        assert fragment in message


def test_missing_batch_sizes_say_which_keys_to_set() -> None:
    for config in ({}, None, {"gradient_accumulation_steps": 2}):
        message = error_of(config)
        assert "train_micro_batch_size_per_gpu" in message and "train_batch_size" in message
    assert "only gradient_accumulation_steps (2) is set" in error_of({"gradient_accumulation_steps": 2})


def test_auto_batch_sizes_count_as_not_given() -> None:
    cfg = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": "auto",
        },
        dp_world_size=2,
    )
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.warnings == []  # inference is normal, nothing to warn about
    message = error_of({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    assert '"auto" counts as not set' in message


@pytest.mark.parametrize("bad", [0, -4, 2.5, "8", True])
def test_batch_sizes_must_be_positive_integers(bad: Any) -> None:
    assert error_of({"train_micro_batch_size_per_gpu": bad}).startswith(
        "train_micro_batch_size_per_gpu: expected a positive integer, got "
    )


def test_integral_float_batch_size_is_accepted() -> None:
    cfg = load_config({"train_batch_size": 64.0}, dp_world_size=2)
    assert cfg.train_batch_size == 64 and type(cfg.train_batch_size) is int


@pytest.mark.parametrize("world", [0, -1, True, 2.0])
def test_world_size_argument_is_checked(world: Any) -> None:
    assert error_of(MICRO1, world).startswith("dp_world_size: expected a positive integer")


# ------------------------------------------------------------------------------------------- unknown keys


def test_misspelled_top_level_key_suggests_nearest() -> None:
    assert error_of({**MICRO1, "gradient_cliping": 1.0}) == (
        'unknown key "gradient_cliping" (did you mean "gradient_clipping"?)'
    )


def test_misspelled_nested_key_names_full_path_and_suggests() -> None:
    message = error_of({**MICRO1, "zero_optimization": {"reduce_bucket_sise": 5}})
    assert message == 'unknown key "zero_optimization.reduce_bucket_sise" (did you mean "reduce_bucket_size"?)'
    message = error_of({**MICRO1, "zero_optimization": {"offload_param": {"devise": "none"}}})
    assert message == 'unknown key "zero_optimization.offload_param.devise" (did you mean "device"?)'
    message = error_of({**MICRO1, "fp16": {"loss_scale_windw": 10}})
    assert message == 'unknown key "fp16.loss_scale_windw" (did you mean "loss_scale_window"?)'


def test_misspelled_ignored_key_is_suggested_too() -> None:
    assert 'did you mean "tensorboard"' in error_of({**MICRO1, "tensorbord": {"enabled": True}})


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("zero_optimisation", "zero_optimization"),  # substitution
        ("zero_optimzation", "zero_optimization"),  # deletion
        ("gradient_clippping", "gradient_clipping"),  # insertion
        ("gradeint_clipping", "gradient_clipping"),  # two neighbours swapped: one edit
        ("Train_Batch_Size", "train_batch_size"),  # case is ignored
        ("tensorbaord", "tensorboard"),  # a DeepSpeed key we ignore is still a key one can misspell
        ("pipelines", "pipeline"),  # ... and a typed section
        ("stepz_per_prnt", "steps_per_print"),  # distance 2: still a misspelling
    ],
)
def test_unknown_key_within_two_edits_is_a_misspelling(key: str, meant: str) -> None:
    assert error_of({**MICRO1, key: {}}) == f'unknown key "{key}" (did you mean "{meant}"?)'


@pytest.mark.parametrize("key", ["cuda_visible_devices", "xyzzy", "my_launcher_options", "stepzz_per_prnt"])
def test_unknown_key_farther_than_two_edits_is_one_warning(key: str) -> None:
    cfg = load({key: {"anything": 1}})
    assert cfg.warnings == [
        f'unknown key "{key}" is ignored: it is not a DeepSpeed key shardspeed knows, nor within 2 edits of one'
    ]


def test_unknown_nested_keys_follow_the_same_rule() -> None:
    cfg = load({"zero_optimization": {"stage": 1, "my_tool_hint": True}, "fp16": {"comment": "x"}})
    assert [w.split(" is ignored")[0] for w in cfg.warnings] == [
        'unknown key "zero_optimization.my_tool_hint"',
        'unknown key "fp16.comment"',
    ]


def test_misspelling_inside_a_tabled_section_is_caught() -> None:
    """Before: ``"enabeld"`` inside an ignored section read as switched off and passed in silence."""
    assert error_of({**MICRO1, "tensorboard": {"enabeld": True}}) == (
        'unknown key "tensorboard.enabeld" (did you mean "enabled"?)'
    )
    assert error_of({**MICRO1, "timers": {"throughput": {"synchronised": True}}}) == (
        'unknown key "timers.throughput.synchronised" (did you mean "synchronized"?)'
    )
    assert load({"wandb": {"enabled": False, "my_tag": "x"}}).warnings == [
        'unknown key "wandb.my_tag" is ignored: it is not a DeepSpeed key shardspeed knows, nor within 2 edits of one'
    ]


def test_edit_distance_is_damerau_levenshtein() -> None:
    from shardspeed.config.errors import edit_distance

    assert edit_distance("enabled", "enabled") == 0
    assert edit_distance("enabeld", "enabled") == 1
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3


def test_internal_fields_are_not_config_keys() -> None:
    assert error_of({**MICRO1, "dp_world_size": 8}) == '"dp_world_size" is not a config key: load_config fills it in'
    assert error_of({**MICRO1, "warnings": []}) == '"warnings" is not a config key: load_config fills it in'


def test_all_problems_are_reported_together() -> None:
    message = error_of({**MICRO1, "zero_optimizaton": {}, "fp16": {"enabeld": True}})
    assert message.startswith("2 problems in the config:")
    assert '"zero_optimizaton" (did you mean "zero_optimization"?)' in message
    assert '"fp16.enabeld" (did you mean "enabled"?)' in message


# ------------------------------------------------------------------------------- DeepSpeed keys we skip


def test_ignored_keys_warn_once_each() -> None:
    cfg = load(
        {
            "comet": {"enabled": True, "project": "p"},
            "trackio": {"enabled": True},
            "memory_breakdown": True,
            "dump_state": True,
        }
    )
    assert len(cfg.warnings) == 4
    for key in ("comet", "trackio", "memory_breakdown", "dump_state"):
        assert sum(f'"{key}" is ignored' in w for w in cfg.warnings) == 1


def test_ignored_keys_that_are_switched_off_do_not_warn() -> None:
    cfg = load({"tensorboard": {"enabled": False}, "csv_monitor": {}, "memory_breakdown": False, "dump_state": False})
    assert cfg.warnings == []


def test_nested_ignored_key_warns_with_path() -> None:
    cfg = load({"fp16": {"enabled": True, "fused_mode": True}})
    assert cfg.warnings == [
        '"fp16.fused_mode" is ignored: shardspeed does not implement '
        "choosing DeepSpeed's fused or unfused fp16 optimizer yet"
    ]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("amp", {"enabled": True, "opt_level": "O1"}),
        ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": True}}}),
        ("sparse_attention", {"mode": "fixed"}),
        ("curriculum_learning", {"enabled": True}),
        ("data_efficiency", {"enabled": True}),
        ("sparse_gradients", True),
        ("progressive_layer_drop", {"enabled": True}),
        ("eigenvalue", {"enabled": True}),
        ("quantize_training", {"enabled": True}),
        ("hybrid_engine", {"enabled": True}),
        ("checkpoint", {"load_universal": True}),
        ("elasticity", {"enabled": True}),
        ("gradient_allreduce_op", "sum"),
        ("sequence_parallel_size", 2),
        ("managed_gradient_accumulation", False),
        ("moe", {"num_experts": 8}),
        ("fp8", {"enabled": True}),
        ("seq_parallel_communication_data_type", "bf16"),
    ],
)
def test_unsupported_deepspeed_keys_are_errors_when_on(key: str, value: Any) -> None:
    message = error_of({**MICRO1, key: value})
    assert message.startswith(f'"{key}" is a DeepSpeed option shardspeed does not support yet (')


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("amp", {"enabled": False, "opt_level": "O1"}),
        ("sparse_gradients", False),
        ("activation_checkpointing", {"partition_activations": False, "number_checkpoints": None}),
        ("checkpoint", {"tag_validation": "Fail", "load_universal": False}),
        ("gradient_allreduce_op", "MEAN"),
        ("sequence_parallel_size", 1),
        ("managed_gradient_accumulation", True),
        ("compile", {"deepcompile": False}),
        ("data_types", {"grad_accum_dtype": None}),
        ("data_types", {"grad_accum_dtype": "fp32"}),
    ],
)
def test_unsupported_keys_switched_off_are_accepted_silently(key: str, value: Any) -> None:
    assert load({key: value}).warnings == []


def test_nested_unsupported_keys() -> None:
    message = error_of({**MICRO1, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})
    assert message.startswith('"fp16.fp16_master_weights_and_grads" is a DeepSpeed option shardspeed does not')
    message = error_of({**MICRO1, "bfloat16": {"enabled": True, "check_overflow": True}})
    assert message.startswith('"bfloat16.check_overflow" is a DeepSpeed option')
    assert load({"bf16": {"enabled": True, "check_grad_overflow": False}}).bf16.enabled


def test_key_tables_are_consistent() -> None:
    assert not set(IGNORED_KEYS) & set(UNSUPPORTED_KEYS)
    top_level_fields = set(ShardSpeedConfig.model_fields)
    for path, rule in {**IGNORED_KEYS, **UNSUPPORTED_KEYS}.items():
        assert path not in top_level_fields, path
        assert rule.is_off(None), path  # null always means "not set"


# ------------------------------------------------------------------------------------------------ ZeRO


def test_zero_defaults_match_deepspeed() -> None:
    zero = load().zero_optimization
    assert zero.stage == 0
    assert zero.contiguous_gradients is True and zero.reduce_scatter is True
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.allgather_partitions is True and zero.overlap_comm is True  # ours: true for every stage
    assert zero.load_from_fp32_weights is True and zero.elastic_checkpoint is False
    assert zero.sub_group_size == 1_000_000_000
    assert zero.prefetch_bucket_size == 50_000_000 and zero.param_persistence_threshold == 100_000
    assert zero.max_live_parameters == 1_000_000_000 and zero.max_reuse_distance == 1_000_000_000
    assert zero.gather_16bit_weights_on_model_save is False and zero.ignore_unused_parameters is True
    assert zero.round_robin_gradients is False and zero.zero_hpz_partition_size == 1
    assert zero.mics_shard_size == -1 and zero.memory_efficient_linear is True
    assert zero.offload_param is None and zero.offload_optimizer is None


def test_zero_sizes_accept_floats_and_become_ints() -> None:
    zero = load(
        {"zero_optimization": {"reduce_bucket_size": 2e8, "stage3_prefetch_bucket_size": 1e7}}
    ).zero_optimization
    assert zero.reduce_bucket_size == 200_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.prefetch_bucket_size == 10_000_000 and type(zero.prefetch_bucket_size) is int


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("reduce_bucket_size", 0, "zero_optimization.reduce_bucket_size: expected a number > 0, got 0"),
        (
            "allgather_bucket_size",
            -5e8,
            "zero_optimization.allgather_bucket_size: expected a number > 0, got -500000000.0",
        ),
        ("sub_group_size", 2.5, "zero_optimization.sub_group_size: expected an integer, got 2.5"),
        ("reduce_bucket_size", "5e8", 'zero_optimization.reduce_bucket_size: expected an integer, got "5e8"'),
        ("overlap_comm", "yes", 'zero_optimization.overlap_comm: expected true or false, got "yes"'),
        (
            "stage3_max_live_parameters",
            -1,
            "zero_optimization.stage3_max_live_parameters: expected a number >= 0, got -1",
        ),
    ],
)
def test_zero_value_errors_name_key_value_and_expectation(key: str, value: Any, expected: str) -> None:
    assert error_of({**MICRO1, "zero_optimization": {key: value}}) == expected


def test_stage3_aliases_store_under_one_field() -> None:
    spellings = {
        "stage3_prefetch_bucket_size": ("prefetch_bucket_size", 123),
        "stage3_param_persistence_threshold": ("param_persistence_threshold", 7),
        "stage3_model_persistence_threshold": ("model_persistence_threshold", 9),
        "stage3_max_live_parameters": ("max_live_parameters", 11),
        "stage3_max_reuse_distance": ("max_reuse_distance", 13),
        "stage3_gather_16bit_weights_on_model_save": ("gather_16bit_weights_on_model_save", True),
        "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save", True),
    }
    for alias, (field, value) in spellings.items():
        zero = load({"zero_optimization": {alias: value}}).zero_optimization
        assert getattr(zero, field) == value, alias
        assert not hasattr(zero, alias) or alias not in ZeroConfig.model_fields


def test_auto_under_one_spelling_and_a_value_under_the_other() -> None:
    cfg = load({"zero_optimization": {"stage3_prefetch_bucket_size": "auto", "prefetch_bucket_size": 7}})
    assert cfg.zero_optimization.prefetch_bucket_size == 7
    assert cfg.warnings == []


def test_alias_and_canonical_spelling_together() -> None:
    zero = load({"zero_optimization": {"max_live_parameters": 5, "stage3_max_live_parameters": 5.0}}).zero_optimization
    assert zero.max_live_parameters == 5
    message = error_of({**MICRO1, "zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2}})
    assert message == (
        '"zero_optimization.stage3_max_live_parameters" and "zero_optimization.max_live_parameters" '
        "are two spellings of one option and disagree (1 vs 2); keep one"
    )


@pytest.mark.parametrize("stage", [-1, 4])
def test_zero_stage_out_of_range(stage: int) -> None:
    assert error_of({**MICRO1, "zero_optimization": {"stage": stage}}) == (
        f"zero_optimization.stage: ZeRO stage must be 0, 1, 2 or 3, got {stage}"
    )


def test_implemented_stages_constant_is_read_at_validation_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zero_module, "IMPLEMENTED_ZERO_STAGES", frozenset({0, 3}))
    zero = load({"zero_optimization": {"stage": 3}}).zero_optimization
    assert zero.stage == 3
    assert zero.overlap_comm is True  # DeepSpeed's stage-3 default
    assert load({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False


def test_param_offload_nvme_needs_a_path() -> None:
    message = error_of({**MICRO1, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert '"zero_optimization.offload_param" with device "nvme" needs "nvme_path"' in message, message
    zero = load({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).zero_optimization
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"


def test_offload_optimizer_buffer_count_below_one_sub_group_is_refused() -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2}}
    message = error_of({**MICRO1, "zero_optimization": zero})
    assert "zero_optimization.offload_optimizer.buffer_count" in message and ">= 3" in message, message
    zero["offload_optimizer"]["buffer_count"] = 4  # DeepSpeed's default still parses (one sub-group in flight)
    assert load({"zero_optimization": zero}).zero_optimization.offload_optimizer.buffer_count == 4


def test_offload_section_with_device_none_parses_with_defaults() -> None:
    zero = load({"zero_optimization": {"offload_optimizer": {"device": "none"}, "offload_param": {}}}).zero_optimization
    assert zero.offload_optimizer is not None and zero.offload_optimizer.buffer_count == 9  # deliberate: overlap
    assert zero.offload_optimizer.pipeline_read and zero.offload_optimizer.pipeline_write
    assert zero.offload_optimizer.ratio == 1.0 and not zero.offload_optimizer.fast_init
    assert zero.offload_param is not None and zero.offload_param.buffer_count == 5
    assert zero.offload_param.buffer_size == 100_000_000 and zero.offload_param.max_in_cpu == 1_000_000_000


def test_offload_device_must_be_known() -> None:
    assert error_of({**MICRO1, "zero_optimization": {"offload_param": {"device": "gpu"}}}) == (
        "zero_optimization.offload_param.device: expected one of 'none', 'cpu' or 'nvme', got \"gpu\""
    )


def test_legacy_cpu_offload_means_the_cpu_offload_section() -> None:
    """DeepSpeed translates the deprecated bools into the sections (old bing_bert configs carry them); before, they
    were refused."""
    zero = load({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    zero = load({"zero_optimization": {"stage": 3, "cpu_offload_param": True}}).zero_optimization
    assert zero.offload_param is not None and zero.offload_param.device == "cpu" and zero.offload_optimizer is None
    agreeing = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert load({"zero_optimization": agreeing}).zero_optimization.offload_optimizer.pin_memory is False
    assert load({"zero_optimization": {"cpu_offload": False}}).zero_optimization.offload_optimizer is None
    message = error_of({**MICRO1, "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {}}})
    assert message == (
        '"zero_optimization.cpu_offload" is true (DeepSpeed\'s old spelling of offload_optimizer with device "cpu") '
        'but "offload_optimizer" has device "none"; keep one'
    )


@pytest.mark.parametrize(
    ("key", "on", "off"),
    [
        ("zero_quantized_weights", True, False),
        ("zero_quantized_gradients", True, False),
        ("zero_quantized_nontrainable_weights", True, False),
        ("zero_hpz_partition_size", 8, 1),
        ("mics_shard_size", 4, -1),
        ("zenflow", {"topk_ratio": 0.1}, None),
    ],
)
def test_zero_features_not_yet_supported(key: str, on: Any, off: Any) -> None:
    message = error_of({**MICRO1, "zero_optimization": {key: on}})
    assert message.startswith(f'"zero_optimization.{key}" = {json.dumps(on)} is a DeepSpeed option shardspeed')
    load({"zero_optimization": {key: off}})


def test_every_documented_zero_key_is_accepted() -> None:
    documented = {
        "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
        "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
        "load_from_fp32_weights": True, "elastic_checkpoint": False, "offload_param": None,
        "offload_optimizer": None, "sub_group_size": 1e9, "cpu_offload": False, "prefetch_bucket_size": 5e7,
        "param_persistence_threshold": 1e5, "model_persistence_threshold": 1e12, "max_live_parameters": 1e9,
        "max_reuse_distance": 1e9, "gather_16bit_weights_on_model_save": False,
        "use_all_reduce_for_fetch_params": False, "ignore_unused_parameters": True, "legacy_stage1": False,
        "round_robin_gradients": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
        "mics_shard_size": -1, "mics_hierarchical_params_gather": False, "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False, "override_module_apply": True,
        "log_trace_cache_warnings": False, "cpu_offload_param": False, "cpu_offload_use_pin_memory": False,
        "compute_grad_norm": True, "parameter_alignment": False, "stage3_module_granularity_threshold": 0,
        "stage3_allgather_sequential": False, "use_multi_rank_bucket_allreduce": True,
    }  # fmt: skip
    cfg = load({"zero_optimization": documented})
    assert cfg.warnings == []


# ------------------------------------------------------------------------------------------------ "auto"


def test_auto_zero_sizes_become_deepspeed_defaults_with_a_warning() -> None:
    cfg = load(
        {
            "zero_optimization": {
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            }
        }
    )
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        500_000_000,
        50_000_000,
        100_000,
    )
    assert len(cfg.warnings) == 3
    assert cfg.warnings[0].startswith(
        '"zero_optimization.reduce_bucket_size" is "auto": using DeepSpeed\'s default 500000000'
    )
    assert cfg.warnings[1].startswith('"zero_optimization.stage3_prefetch_bucket_size" is "auto"')


AUTO_ERROR = '"{}" is "auto", which only the HF Trainer can fill in; {}'


@pytest.mark.parametrize(
    ("config", "path", "hint"),
    [
        ({"gradient_clipping": "auto"}, "gradient_clipping", "set a number"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled", "set true or false"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled", "set true or false"),
        ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage", "set a number"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr", "set a number"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
            "scheduler.params.warmup_num_steps",
            "set a number",
        ),
        ({"optimizer": {"type": "auto"}}, "optimizer.type", "set a value"),
    ],
)
def test_auto_where_it_cannot_be_resolved(config: dict, path: str, hint: str) -> None:
    assert error_of({**MICRO1, **config}) == AUTO_ERROR.format(path, hint)


def test_auto_inside_a_list_names_the_element() -> None:
    message = error_of({**MICRO1, "optimizer": {"type": "Adam", "params": {"betas": ["auto", 0.999]}}})
    assert message == '"optimizer.params.betas[0]" is "auto", which only the HF Trainer can fill in; set a number'


# ------------------------------------------------------------------------------------------- precision


def test_precision_defaults_match_deepspeed() -> None:
    cfg = load()
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power) == (
        False,
        False,
        0.0,
        16,
    )
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.consecutive_hysteresis) == (1000, 2, False)
    assert fp16.min_loss_scale == 1.0
    assert cfg.bf16.enabled is False
    assert cfg.compute_dtype == torch.float32


def test_compute_dtype_and_bfloat16_alias() -> None:
    assert load({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert load({"bf16": {"enabled": True}}).compute_dtype == torch.bfloat16
    assert load({"bfloat16": {"enabled": True}}).compute_dtype == torch.bfloat16
    assert load({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}).bf16.enabled
    assert "are two spellings of one option" in error_of(
        {**MICRO1, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}}
    )


def test_fp16_and_bf16_together_is_an_error() -> None:
    assert error_of({**MICRO1, "fp16": {"enabled": True}, "bf16": {"enabled": True}}) == (
        '"fp16.enabled" and "bf16.enabled" are both true; mixed precision uses one 16-bit format, so enable at most one'
    )
    load({"fp16": {"enabled": True}, "bf16": {"enabled": False}})


@pytest.mark.parametrize(
    ("fp16", "expected"),
    [
        ({"loss_scale": -1}, "fp16.loss_scale: expected a number >= 0, got -1"),
        ({"hysteresis": 0}, "fp16.hysteresis: expected a number > 0, got 0"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window: expected a number > 0, got 0"),
        ({"initial_scale_power": 200}, "fp16.initial_scale_power: expected a number <= 127, got 200"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale: expected a number > 0, got 0"),
        ({"enabled": 1}, "fp16.enabled: expected true or false, got 1"),
        ({"enabled": "true"}, 'fp16.enabled: expected true or false, got "true"'),
    ],
)
def test_fp16_value_errors(fp16: dict, expected: str) -> None:
    assert error_of({**MICRO1, "fp16": fp16}) == expected


def test_static_loss_scale_and_float_fields() -> None:
    fp16 = load({"fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 0.5}}).fp16
    assert fp16.loss_scale == 128.0 and fp16.min_loss_scale == 0.5


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
    ],
)
def test_communication_data_type_names(name: str, dtype: torch.dtype) -> None:
    assert load({"communication_data_type": name}).communication_data_type == dtype


def test_communication_data_type_default_and_errors() -> None:
    assert load().communication_data_type is None
    assert load({"communication_data_type": None}).communication_data_type is None
    message = error_of({**MICRO1, "communication_data_type": "int8"})
    assert message.startswith('communication_data_type: expected one of "fp32", "float32", "fp16"')
    assert message.endswith('got "int8"')
    assert load_config(
        {**MICRO1, "communication_data_type": torch.bfloat16}, dp_world_size=1
    ).communication_data_type == (torch.bfloat16)


# -------------------------------------------------------------------------------------- other sections


def test_top_level_defaults() -> None:
    cfg = load()
    assert cfg.gradient_clipping == 0.0
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.zero_allow_untested_optimizer is False
    assert cfg.steps_per_print == 10 and cfg.wall_clock_breakdown is False and cfg.seed is None
    assert cfg.optimizer is None and cfg.scheduler is None
    logger = cfg.comms_logger
    assert (logger.enabled, logger.verbose, logger.prof_all, logger.debug, logger.prof_ops) == (
        False,
        False,
        True,
        False,
        [],
    )


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"gradient_clipping": -1.0}, "gradient_clipping: expected a number >= 0, got -1.0"),
        ({"gradient_clipping": math.nan}, "gradient_clipping: expected a finite number, got NaN"),
        ({"gradient_clipping": True}, "gradient_clipping: expected a number, got true"),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor: expected a number > 0, got 0"),
        ({"steps_per_print": 0}, "steps_per_print: expected a number > 0, got 0"),
        ({"seed": -3}, "seed: expected a number >= 0, got -3"),
        ({"comms_logger": {"prof_ops": [1]}}, "comms_logger.prof_ops[0]: expected a string, got 1"),
        ({"fp16": True}, "fp16: expected an object (a JSON dict), got true"),
        ({"optimizer": {"params": {}}}, "optimizer.type: required key is missing"),
        ({"optimizer": {"type": ""}}, 'optimizer.type: expected a non-empty string, got ""'),
    ],
)
def test_value_errors_name_path_value_and_expectation(config: dict, expected: str) -> None:
    assert error_of({**MICRO1, **config}) == expected


def test_optimizer_and_scheduler_params_go_through_their_validators(fake_params_validators: list) -> None:
    cfg = load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": None},
        }
    )
    assert fake_params_validators == [
        ("optimizer", "AdamW", {"lr": 1e-3}, "optimizer.params"),
        ("scheduler", "WarmupLR", {}, "scheduler.params"),
    ]
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {"lr": 1e-3}
    assert cfg.scheduler is not None and cfg.scheduler.params == {}


def test_params_validator_result_is_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    def fill_defaults(type_name: str, params: dict, path: str = "optimizer.params") -> dict:
        return {"lr": params["lr"], "eps": 1e-8}

    monkeypatch.setattr(shardspeed.optim, "validate_optimizer_params", fill_defaults)
    cfg = load({"optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    assert cfg.optimizer is not None and cfg.optimizer.params == {"lr": 0.1, "eps": 1e-8}


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (
            "optimizer.params.lr: expected a number > 0, got -1",
            "optimizer.params.lr: expected a number > 0, got -1",
        ),
        ('optimizer.type: unknown optimizer "Adamm"', 'optimizer.type: unknown optimizer "Adamm"'),
        ("lr must be positive", "optimizer.params: lr must be positive"),
    ],
)
def test_params_validator_errors_carry_the_key_path(
    monkeypatch: pytest.MonkeyPatch, raised: str, expected: str
) -> None:
    def reject(type_name: str, params: dict, path: str = "optimizer.params") -> dict:
        raise ConfigError(raised)

    monkeypatch.setattr(shardspeed.optim, "validate_optimizer_params", reject)
    assert error_of({**MICRO1, "optimizer": {"type": "Adam", "params": {"lr": -1}}}) == expected


# ---------------------------------------------------------------------------------------- sources, purity


HF_STYLE_FP16 = {
    "fp16": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": False},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-5,
            "warmup_num_steps": 100,
            "total_num_steps": 1000,
        },
    },
    "zero_optimization": {
        "stage": 0,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 8,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "finetune"},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
}


def test_real_world_hf_style_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_STYLE_FP16, indent=2))
    cfg = load_config(path, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        64,
        8,
        4,
    )
    assert cfg.fp16.enabled and cfg.compute_dtype == torch.float16
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 2000
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is True
    assert zero.allgather_bucket_size == 200_000_000 and zero.reduce_bucket_size == 500_000_000
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 3e-5
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"
    assert len(cfg.warnings) == 1  # reduce_bucket_size "auto" (tensorboard is a typed section)
    assert cfg.tensorboard.enabled and (cfg.tensorboard.output_path, cfg.tensorboard.job_name) == ("logs/", "finetune")
    assert load_config(str(path), dp_world_size=2) == cfg


def test_real_world_bf16_config() -> None:
    config = copy.deepcopy(HF_STYLE_FP16)
    del config["fp16"]
    config["bf16"] = {"enabled": True}
    config["communication_data_type"] = "fp32"
    cfg = load_config(config, dp_world_size=4)
    assert cfg.compute_dtype == torch.bfloat16 and cfg.communication_data_type == torch.float32
    assert cfg.train_batch_size == 8 * 4 * 4


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    assert error_of(path) == f"config file {path} does not exist"


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    message = error_of(path)
    assert message.startswith(f"config file {path} is not valid JSON: ")
    assert "line 3, column" in message


def test_duplicate_json_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert error_of(path).startswith(f'config file {path} has the key "train_batch_size" twice')


def test_json_file_must_hold_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_of(path) == f"config file {path} must hold a JSON object ({{...}}), got [1, 2]"


def test_unsupported_config_type() -> None:
    assert error_of([("train_batch_size", 8)]) == (
        "config: expected a dict, a path to a JSON file, or None, got a list"
    )


def test_load_is_pure_and_does_not_modify_its_input() -> None:
    config = copy.deepcopy(HF_STYLE_FP16)
    before = copy.deepcopy(config)
    assert load_config(config, dp_world_size=2) == load_config(config, dp_world_size=2)
    assert config == before
    bad = {**MICRO1, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 1}}
    assert error_of(bad) == error_of(copy.deepcopy(bad))


def test_pydantic_errors_never_leak() -> None:
    with pytest.raises(ConfigError) as info:
        load({"fp16": {"hysteresis": "two"}})
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "Input should" not in str(info.value) and "pydantic" not in str(info.value)


def test_parsed_config_is_immutable() -> None:
    cfg = load()
    with pytest.raises(pydantic.ValidationError):
        cfg.train_batch_size = 99  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.zero_optimization.stage = 1  # type: ignore[misc]


def test_gradient_communication_dtype_defaults_to_the_training_dtype() -> None:
    """DeepSpeed's rule: ``communication_data_type`` unset means the training dtype; an explicit "fp32" wins."""
    assert load().grad_comm_dtype == torch.float32
    assert load({"bf16": {"enabled": True}}).grad_comm_dtype == torch.bfloat16
    assert load({"fp16": {"enabled": True}}).grad_comm_dtype == torch.float16
    assert load({"bf16": {"enabled": True}, "communication_data_type": "fp32"}).grad_comm_dtype == torch.float32


def test_grad_accum_dtype_other_than_fp32_is_refused() -> None:
    message = error_of({**MICRO1, "data_types": {"grad_accum_dtype": "bf16"}})
    assert "data_types.grad_accum_dtype" in message and "accumulates gradients in fp32 only" in message
    message = error_of({**MICRO1, "data_types": {"grad_accum_dtype": "fp16"}})
    assert "data_types.grad_accum_dtype" in message and "accumulates gradients in fp32 only" in message
