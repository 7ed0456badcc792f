"""Config rules for bf16 master weights / optimizer states and torch_autocast (DeepSpeed PR 7700's rules)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.config import ConfigError, load_config

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
FULL_BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _error(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **config}, dp_world_size=1)
    return str(info.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_full_loads_and_sets_the_master_dtype(stage: int) -> None:
    # DeepSpeedExamples training/bf16_master_weight's bf16_full.json (stage varied)
    config = load_config(
        {
            **BASE,
            "bf16": FULL_BF16,
            "zero_optimization": {"stage": stage},
            "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
        },
        dp_world_size=1,
    )
    assert config.master_dtype == torch.bfloat16 and config.compute_dtype == torch.bfloat16
    assert config.torch_autocast.enabled and config.torch_autocast.dtype == torch.bfloat16
    assert config.warnings == []
    assert load_config(BASE, dp_world_size=1).master_dtype == torch.float32


def test_optimizer_states_require_master_weights() -> None:
    message = _error({"bf16": {"enabled": True, "bf16_optimizer_states": True}})
    assert message.startswith('"bf16.bf16_optimizer_states" requires "bf16.bf16_master_weights_and_grads": true')


def test_grad_accum_dtype_follows_the_master_dtype() -> None:
    config = load_config({**BASE, "bf16": FULL_BF16, "data_types": {"grad_accum_dtype": "bf16"}}, dp_world_size=1)
    assert config.data_types.grad_accum_dtype == torch.bfloat16
    message = _error({"bf16": FULL_BF16, "data_types": {"grad_accum_dtype": "fp32"}})
    assert message.startswith('"data_types.grad_accum_dtype" = "float32": shardspeed accumulates gradients in bf16')
    message = _error({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}})
    assert "accumulates gradients in fp32 only" in message


def test_master_weights_without_bf16_states_are_refused_naming_the_key() -> None:
    message = _error({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    assert '"bf16.bf16_master_weights_and_grads" without "bf16.bf16_optimizer_states": true' in message


def test_master_weights_require_bf16_enabled() -> None:
    message = _error({"bf16": {**FULL_BF16, "enabled": False}})
    assert '"bf16.bf16_master_weights_and_grads" requires "bf16.enabled": true' in message


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_master_weights_with_offload_are_refused(section: str) -> None:
    zero = {"stage": 3, section: {"device": "cpu"}}
    message = _error({"bf16": FULL_BF16, "zero_optimization": zero})
    assert "bf16.bf16_master_weights_and_grads" in message and f"zero_optimization.{section}" in message


def test_torch_autocast_rules() -> None:
    assert "bfloat16 only" in _error({"torch_autocast": {"enabled": True, "dtype": "fp16"}})
    message = _error({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert message.startswith('"torch_autocast.lower_precision_safe_modules" = ')
    message = _error({"fp16": {"enabled": True}, "torch_autocast": {"enabled": True}})
    assert '"torch_autocast.enabled" with "fp16.enabled" is not supported' in message
    # default dtype is bfloat16, as in DeepSpeed
    assert load_config({**BASE, "torch_autocast": {"enabled": True}}, dp_world_size=1).torch_autocast.dtype == (
        torch.bfloat16
    )
