"""The ``pipeline`` section (config/pipeline.py): DeepSpeed's keys typed and validated, shardspeed's ``schedule`` and
``zero_hold``, and ``pipeline_config_conflicts`` (the module's settings decide: [Note: the module decides]). Pure."""

from __future__ import annotations

from typing import Any

import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.config.pipeline import ModuleSettings, PipelineConfig, pipeline_config_conflicts

MODULE = ModuleSettings(
    num_stages=2, partition_method="parameters", seed_layers=False, activation_checkpoint_interval=0
)


def pipe(section: dict[str, Any]) -> PipelineConfig:
    return load_config({"train_batch_size": 8, "pipeline": section}, dp_world_size=1).pipeline


def error_of(section: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "pipeline": section}, dp_world_size=1)
    return str(info.value)


def test_defaults_are_deepspeeds() -> None:
    cfg = load_config({"train_batch_size": 8}, dp_world_size=1)
    assert cfg.pipeline == PipelineConfig()
    p = cfg.pipeline
    assert (p.stages, p.partition, p.seed_layers, p.activation_checkpoint_interval) == ("auto", "best", False, 0)
    assert (p.pipe_partitioned, p.grad_partitioned, p.schedule, p.zero_hold) == (True, True, "1f1b", "step")
    assert cfg.warnings == []


def test_every_key_is_read() -> None:
    p = pipe(
        {
            "stages": 4,
            "partition": "type:Block",
            "seed_layers": True,
            "activation_checkpoint_interval": 2,
            "pipe_partitioned": False,
            "grad_partitioned": False,
            "schedule": "Interleaved",
            "zero_hold": "micro_batch",
        }
    )
    assert (p.stages, p.partition, p.seed_layers, p.activation_checkpoint_interval) == (4, "type:Block", True, 2)
    assert (p.pipe_partitioned, p.grad_partitioned, p.schedule, p.zero_hold) == (
        False,
        False,
        "interleaved",
        "micro_batch",
    )


def test_auto_stages_is_a_value_not_the_hf_placeholder() -> None:
    cfg = load_config({"train_batch_size": 8, "pipeline": {"stages": "auto"}}, dp_world_size=1)
    assert cfg.pipeline.stages == "auto" and cfg.warnings == []
    assert pipe({"stages": 2.0}).stages == 2  # a generated config's float


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stages": 0}, 'pipeline.stages: expected "auto" or a positive integer, got 0'),
        ({"stages": "two"}, 'pipeline.stages: expected "auto" or a positive integer, got "two"'),
        ({"stages": True}, 'pipeline.stages: expected "auto" or a positive integer, got true'),
        ({"partition": "profile"}, 'pipeline.partition: "profile" is not a partition method'),
        ({"partition": "type:["}, 'pipeline.partition: "type:[": the pattern after "type:" is not a regular'),
        ({"seed_layers": "yes"}, "pipeline.seed_layers"),
        ({"activation_checkpoint_interval": -1}, "pipeline.activation_checkpoint_interval"),
        ({"schedule": "zero_bubble"}, "pipeline.schedule: expected one of '1f1b', 'gpipe' or 'interleaved'"),
        ({"zero_hold": "never"}, "pipeline.zero_hold: expected one of 'step' or 'micro_batch'"),
        ({"stagse": 2}, 'unknown key "pipeline.stagse" (did you mean "stages"?)'),
        ({"schedule": "auto"}, '"pipeline.schedule" is "auto", which only the HF Trainer can fill in'),
    ],
)
def test_bad_values_name_the_key(section: dict[str, Any], message: str) -> None:
    assert message in error_of(section)


def test_pipeline_tutorial_config_loads() -> None:
    # DeepSpeed's pipeline tutorial: seed_layers / activation_checkpoint_interval, 32 GPUs
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "compat" / "configs" / "pipeline_tutorial.json"
    cfg = load_config(path, dp_world_size=32)
    assert cfg.pipeline.seed_layers and cfg.pipeline.activation_checkpoint_interval == 1
    assert cfg.warnings == []


# --- conflicts with the module ----------------------------------------------------------------------------------
def test_defaults_never_conflict() -> None:
    assert pipeline_config_conflicts(PipelineConfig(), MODULE) == ([], [])
    odd = ModuleSettings(num_stages=3, partition_method="uniform", seed_layers=True, activation_checkpoint_interval=2)
    assert pipeline_config_conflicts(PipelineConfig(), odd) == ([], [])


def test_stage_count_disagreeing_is_an_error_naming_both() -> None:
    errors, warnings = pipeline_config_conflicts(pipe({"stages": 4}), MODULE)
    assert errors == [
        'pipeline.stages is 4 but the PipelineModule has 2 stages: set "stages" to 2 or "auto", or build the module '
        "with num_stages=4"
    ]
    assert warnings == []
    assert pipeline_config_conflicts(pipe({"stages": 2}), MODULE) == ([], [])


def test_module_settings_win_with_one_warning_each() -> None:
    cfg = pipe({"partition": "uniform", "seed_layers": True, "activation_checkpoint_interval": 1})
    errors, warnings = pipeline_config_conflicts(cfg, MODULE)
    assert errors == []
    assert len(warnings) == 3
    assert warnings[0].startswith(
        "pipeline.partition is 'uniform' but the PipelineModule was built with partition_method='parameters': the "
        "module's value is used"
    )
    assert "pipeline.seed_layers is True but the PipelineModule was built with seed_layers=False" in warnings[1]
    assert "activation_checkpoint_interval is 1 but the PipelineModule was built with " in warnings[2]


def test_set_values_equal_to_the_modules_are_silent() -> None:
    cfg = pipe({"partition": "Parameters", "seed_layers": False, "activation_checkpoint_interval": 0, "stages": 2})
    assert pipeline_config_conflicts(cfg, MODULE) == ([], [])
    typed = {**MODULE.__dict__, "partition_method": "type:Block"}
    assert pipeline_config_conflicts(pipe({"partition": "type:Block"}), typed) == ([], [])  # a mapping works too
    assert pipeline_config_conflicts(pipe({"partition": "type:block"}), typed)[1]  # the regex is case-sensitive
    assert pipeline_config_conflicts(pipe({"partition": "best"}), typed) == ([], [])  # DeepSpeed's "no opinion"


def test_deepspeed_config_exposes_the_pipeline_dict() -> None:
    from shardspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig({"train_batch_size": 8, "pipeline": {"stages": 2, "seed_layers": True}})
    assert ds.pipeline == {
        "stages": 2,
        "partition": "best",
        "seed_layers": True,
        "activation_checkpoint_interval": 0,
        "pipe_partitioned": True,
        "grad_partitioned": True,
        "schedule": "1f1b",
        "zero_hold": "step",
    }
