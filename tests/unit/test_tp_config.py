"""The ``tensor_parallel`` section (config/tensor_parallel.py): DeepSpeed 0.19's AutoTP keys typed and validated."""

from __future__ import annotations

from typing import Any

import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.config.tensor_parallel import AUTOTP_PRESETS
from shardspeed.tensor_parallel.hf_plans import PRESETS


def _load(section: dict[str, Any]):
    return load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": section}, dp_world_size=1)


def _error(section: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as error:
        _load(section)
    return str(error.value)


def test_deepspeed_tutorial_section_loads_typed() -> None:
    cfg = _load(
        {
            "autotp_size": 2,
            "preset_model": "LLaMA",
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$"], "partition_type": "row"},
                    {"patterns": [".*\\.[qkv]_proj\\.weight$"], "partition_type": "column"},
                    {
                        "patterns": [".*\\.gate_up_proj\\.weight$"],
                        "partition_type": "column",
                        "shape": [2, -1],
                        "partition_dim": 0,
                    },
                    {"patterns": [".*gate$"], "partition_type": "SKIP"},
                ],
            },
        }
    )
    tp = cfg.tensor_parallel
    assert cfg.warnings == []
    assert tp.enabled and tp.autotp_size == 2 and tp.preset_model == "llama" and not tp.sequence_parallel
    specs = tp.layer_specs
    assert [s.partition_type for s in specs] == ["row", "column", "column", "skip"]
    assert specs[0].patterns == (".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$")
    assert [s.fused_parts() for s in specs] == [1, 1, 2, 1]
    assert tp.partition_config is not None and tp.partition_config.use_default_specs is False


def test_off_by_default_and_at_size_one() -> None:
    assert not load_config({"train_micro_batch_size_per_gpu": 1}, dp_world_size=1).tensor_parallel.enabled
    assert not _load({"autotp_size": 1}).tensor_parallel.enabled


def test_sequence_parallel_is_a_typed_shardspeed_key() -> None:
    assert _load({"autotp_size": 2, "sequence_parallel": True}).tensor_parallel.sequence_parallel
    assert "set true or false" in _error({"sequence_parallel": "yes"}) or "sequence_parallel" in _error(
        {"sequence_parallel": "yes"}
    )


def test_presets_listed_in_the_config_are_the_ones_shipped() -> None:
    assert set(AUTOTP_PRESETS) == set(PRESETS)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"preset_model": "bloom"}, '"bloom" is a DeepSpeed preset shardspeed does not ship yet'),
        ({"preset_model": "gpt3"}, 'unknown preset "gpt3"'),
        ({"autotp_size": -1}, "tensor_parallel.autotp_size"),
        ({"partition_config": {"layer_specs": [{"patterns": []}]}}, "at least one pattern"),
        ({"partition_config": {"layer_specs": [{"patterns": ["(unclosed"]}]}}, "is not a regular expression"),
        ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diag"}]}}, "partition_type"),
        (
            {"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "row", "partition_dim": 0}]}},
            "a row-parallel layer splits dim 1",
        ),
        (
            {"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [[16, 8, 8], -1]}]}},
            "unequal blocks (a nested list)",
        ),
        (
            {"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [4, -1, 8], "partition_dim": 0}]}},
            "reshapes to other ranks are not supported yet",
        ),
        (
            {
                "partition_config": {
                    "layer_specs": [{"patterns": ["x"], "partition_type": "row", "gather_output": True}]
                }
            },
            "applies to column layers only",
        ),
        (
            {
                "partition_config": {
                    "layer_specs": [{"patterns": ["x"], "partition_type": "skip", "grad_allreduce": True}]
                }
            },
            "grad_allreduce",
        ),
        ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_typ": "row"}]}}, "partition_typ"),
        ({"autotp_sise": 2}, 'unknown key "tensor_parallel.autotp_sise" (did you mean "autotp_size"?)'),
        ({"replace_with_kernel_inject": True}, "DeepSpeed inference kernels"),
        ({"tp": {"mpu": "mine"}}, "pass mpu= to initialize instead"),
    ],
)
def test_bad_values_are_errors_naming_the_key(section: dict[str, Any], expected: str) -> None:
    message = _error(section)
    assert expected in message, message


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"tp_overlap_comm": True}, "tensor_parallel.tp_overlap_comm"),
        ({"tp": {"tp_grain_size": 64}}, "tensor_parallel.tensor_parallel.tp_grain_size"),
        ({"keep_module_on_host": True}, "tensor_parallel.keep_module_on_host"),
    ],
)
def test_inference_and_performance_keys_warn_once(section: dict[str, Any], key: str) -> None:
    warnings = _load(section).warnings
    assert len(warnings) == 1 and warnings[0].startswith(f'"{key}"'), warnings
