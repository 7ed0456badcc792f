"""The ``activation_checkpointing`` config section and how ``checkpointing.configure`` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardspeed import checkpointing
from shardspeed.config import ConfigError, load_config
from shardspeed.config.activation import ActivationCheckpointingConfig

MICRO1 = {"train_micro_batch_size_per_gpu": 1}


@pytest.fixture(autouse=True)
def _no_default_context() -> None:
    checkpointing.set_default_context(None)
    yield
    checkpointing.set_default_context(None)


def test_defaults_match_deepspeed() -> None:
    section = load_config(MICRO1, dp_world_size=1).activation_checkpointing
    assert section == ActivationCheckpointingConfig()
    assert section.model_dump() == {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


def test_every_key_is_read() -> None:
    given = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    section = load_config({**MICRO1, "activation_checkpointing": given}, dp_world_size=2).activation_checkpointing
    assert section.model_dump() == given


def test_number_checkpoints_accepts_integral_floats() -> None:
    cfg = load_config({**MICRO1, "activation_checkpointing": {"number_checkpoints": 8.0}}, dp_world_size=1)
    assert cfg.activation_checkpointing.number_checkpoints == 8
    assert type(cfg.activation_checkpointing.number_checkpoints) is int


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"partition_activations": "true"}, "activation_checkpointing.partition_activations: expected true or false"),
        ({"number_checkpoints": 0}, "activation_checkpointing.number_checkpoints: expected a number > 0, got 0"),
        ({"profile": 1}, "activation_checkpointing.profile: expected true or false, got 1"),
        (
            {"contiguous_memory_optimization": True, "number_checkpoints": 2},
            '"activation_checkpointing.contiguous_memory_optimization" is true but "partition_activations" is false',
        ),
        (
            {"contiguous_memory_optimization": True, "partition_activations": True},
            '"activation_checkpointing.number_checkpoints" is required when "contiguous_memory_optimization"',
        ),
        (
            {"cpu_checkpointin": True},
            'unknown key "activation_checkpointing.cpu_checkpointin" (did you mean "cpu_checkpointing"?)',
        ),
    ],
)
def test_bad_values_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config({**MICRO1, "activation_checkpointing": section}, dp_world_size=1)
    assert message in str(raised.value)


def test_configure_reads_the_section_of_a_whole_config_without_batch_keys(tmp_path: Path) -> None:
    ds_config = {"zero_optimization": {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True}}
    assert checkpointing.configure(deepspeed_config=ds_config).config.cpu_checkpointing is True
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"profile": True, "number_checkpoints": 3}}))
    config = checkpointing.configure(deepspeed_config=str(path)).config
    assert (config.profile, config.number_checkpoints, config.cpu_checkpointing) == (True, 3, False)
    parsed = load_config({**MICRO1, "activation_checkpointing": {"partition_activations": True}}, dp_world_size=1)
    assert checkpointing.configure(deepspeed_config=parsed).config.partition_activations is True
    section = ActivationCheckpointingConfig(synchronize_checkpoint_boundary=True)
    assert checkpointing.configure(deepspeed_config=section).config is section


def test_configure_errors_in_the_section_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.number_checkpoints: expected a number > 0"):
        checkpointing.configure(deepspeed_config={"activation_checkpointing": {"number_checkpoints": -1}})
    with pytest.raises(ConfigError, match=r'"activation_checkpointing\.partition_activation" \(did you mean'):
        checkpointing.configure(deepspeed_config={"activation_checkpointing": {"partition_activation": True}})


def test_keyword_arguments_override_the_config() -> None:
    ds_config = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    config = checkpointing.configure(
        deepspeed_config=ds_config,
        checkpoint_in_cpu=False,
        contiguous_checkpointing=True,
        num_checkpoints=6,
        synchronize=True,
        profile=True,
    ).config
    assert config.model_dump() == {
        "partition_activations": True,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 6,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    assert checkpointing.configure(deepspeed_config=ds_config, partition_activations=None).config.partition_activations


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"checkpoint_in_cpu": "yes"}, TypeError, "configure(checkpoint_in_cpu='yes'): expected True, False or None"),
        ({"num_checkpoints": 0}, ValueError, "configure(num_checkpoints=0): expected a positive integer"),
        ({"num_checkpoints": True}, ValueError, "configure(num_checkpoints=True)"),
        (
            {"contiguous_checkpointing": True, "num_checkpoints": 2},
            ValueError,
            'contiguous_memory_optimization" is true but "partition_activations" is false',
        ),
    ],
)
def test_bad_keyword_arguments_name_the_argument(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        checkpointing.configure(**kwargs)
    assert message in str(raised.value)


def test_configure_rejects_a_non_config() -> None:
    with pytest.raises(ConfigError, match="expected a dict, a path to a JSON file, or None, got a int"):
        checkpointing.configure(deepspeed_config=3)


def test_configure_warns_about_a_foreign_key_in_the_section() -> None:
    """An unknown key far from every known one is ignored with one warning (config/normalize.py), here as well."""
    import logging

    from shardspeed.log import logger

    seen: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = _Collect(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        config = checkpointing.configure(deepspeed_config={"activation_checkpointing": {"my_note": "x"}}).config
    finally:
        logger.removeHandler(handler)
    assert config == ActivationCheckpointingConfig()
    assert seen == [
        'unknown key "activation_checkpointing.my_note" is ignored: it is not a DeepSpeed key shardspeed knows, nor '
        "within 2 edits of one"
    ]
