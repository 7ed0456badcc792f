"""``"auto"`` in a DeepSpeed config filled from TrainingArguments as transformers does (``fill_auto``); values that
disagree are one error listing each; the HF integration does not pose as the ``deepspeed`` package."""

from __future__ import annotations

import sys

import pytest

from shardspeed.config import load_config
from shardspeed.integrations.hf.config import TrainerValues, fill_auto, model_hidden_size


def _values(**overrides) -> TrainerValues:
    base = dict(
        world_size=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        max_grad_norm=0.5,
        learning_rate=3e-4,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.1,
        fp16=False,
        bf16=True,
        num_training_steps=100,
        warmup_steps=10,
        hidden_size=64,
    )
    return TrainerValues(**{**base, **overrides})


AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")},
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def test_every_auto_key_is_filled_from_the_training_arguments() -> None:
    filled = fill_auto(AUTO_CONFIG, _values())
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 3
    assert filled["train_batch_size"] == 2 * 4 * 3
    assert filled["gradient_clipping"] == 0.5
    assert filled["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    assert filled["bf16"] == {"enabled": True} and filled["fp16"] == {"enabled": False}
    zero = filled["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (64 * 64, int(0.9 * 64 * 64))
    assert zero["stage3_param_persistence_threshold"] == 640
    assert AUTO_CONFIG["gradient_clipping"] == "auto"  # the caller's dict is not modified
    cfg = load_config(filled, dp_world_size=2)  # and shardspeed's loader takes the result
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 3, 24)
    assert cfg.gradient_clipping == 0.5


def test_values_that_disagree_with_the_training_arguments_are_one_error_naming_each() -> None:
    config = {**AUTO_CONFIG, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError) as err:
        fill_auto(config, _values())
    message = str(err.value)
    assert "gradient_accumulation_steps=2 vs hf gradient_accumulation_steps=3" in message
    assert "optimizer.params.lr=0.001 vs hf learning_rate=0.0003" in message
    assert "train_batch_size" not in message  # still "auto": filled, not a mismatch


def test_matching_values_and_absent_keys_are_left_alone() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}
    assert fill_auto(config, _values()) == config


def test_hidden_size_autos_need_a_hidden_size() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        fill_auto({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, _values(hidden_size=None))


def test_model_hidden_size_reads_hf_configs() -> None:
    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Model:
        def __init__(self, config):
            self.config = config

    assert model_hidden_size(Model(Cfg(hidden_size=32))) == 32
    assert model_hidden_size(Model(Cfg(hidden_sizes=[8, 48, 16]))) == 48
    assert model_hidden_size(Model(Cfg(text_config=Cfg(hidden_size=24)))) == 24
    assert model_hidden_size(object()) is None


def test_the_integration_does_not_pose_as_deepspeed() -> None:
    pytest.importorskip("transformers")
    before = sys.modules.get("deepspeed")
    import shardspeed.integrations.hf.trainer  # noqa: F401

    assert sys.modules.get("deepspeed") is before  # nothing registered under DeepSpeed's name
