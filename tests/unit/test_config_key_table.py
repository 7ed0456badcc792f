"""The DeepSpeed key table (config/key_table.py): complete against DeepSpeed's inventory and the typed config,
consistent with what the loader does, and its rendered copy (docs/deepspeed_config_keys.md) current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardspeed.config import ConfigError, ShardSpeedConfig, load_config
from shardspeed.config.base import ConfigModel
from shardspeed.config.effects import FIELD_EFFECTS
from shardspeed.config.key_table import SHARDSPEED_ONLY_KEYS, key_table, render_markdown
from shardspeed.config.keys import IGNORED_KEYS, SECTION_KEYS, UNSUPPORTED_KEYS
from shardspeed.config.normalize import _section_model

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = json.loads((ROOT / "tests/compat/deepspeed_config_keys.json").read_text())["keys"]
ROWS = {row.path: row for row in key_table()}


def _typed(model: type[ConfigModel], prefix: str = "") -> dict[str, bool]:
    """Typed path -> whether it is a section."""
    out: dict[str, bool] = {}
    for name, info in model.model_fields.items():
        if name in model.INTERNAL_FIELDS:
            continue
        path = f"{prefix}.{name}" if prefix else name
        section, _ = _section_model(info.annotation)
        out[path] = section is not None
        if section is not None:
            out.update(_typed(section, path))
    return out


TYPED = _typed(ShardSpeedConfig)


def test_every_deepspeed_key_is_classified_and_nothing_else_is() -> None:
    assert len(INVENTORY) == len(set(INVENTORY))
    assert sorted(set(ROWS) - SHARDSPEED_ONLY_KEYS) == sorted(INVENTORY)


def test_every_row_has_a_status_and_a_reason() -> None:
    for row in ROWS.values():
        assert row.status in ("implemented", "ignored", "refused") and row.detail, row


def test_typed_fields_and_table_agree() -> None:
    """Every typed field is a row whose status is its effect; every implemented row is a typed field or alias."""
    kind_of = {"acts": "implemented", "warns": "ignored", "refused": "refused"}
    for path, is_section in TYPED.items():
        expected = "implemented" if is_section else kind_of[FIELD_EFFECTS[path].kind]
        assert ROWS[path].status == expected, path
    for path, row in ROWS.items():
        if row.status == "implemented":
            assert path in TYPED or row.alias_of in TYPED, path


def test_tabled_keys_are_not_typed_and_sections_are_tabled() -> None:
    assert not set(TYPED) & (set(IGNORED_KEYS) | set(UNSUPPORTED_KEYS))
    assert not set(IGNORED_KEYS) & set(UNSUPPORTED_KEYS)
    for section in SECTION_KEYS:
        top = section.split(".")[0]
        assert top in IGNORED_KEYS or top in UNSUPPORTED_KEYS, section


def test_rendered_table_is_current() -> None:
    """Regenerate with: PYTHONPATH=src python -m shardspeed.config.key_table > docs/deepspeed_config_keys.md"""
    assert (ROOT / "docs/deepspeed_config_keys.md").read_text() == render_markdown()


def _nested(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _config(path: str, value: Any) -> dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": 1, **_nested(path, value)}
    if path.startswith("zero_optimization."):
        config["zero_optimization"] = {"stage": 3, **config["zero_optimization"]}
    if path.startswith("optimizer."):
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}, **config["optimizer"]}
    return config


def _off_value(path: str) -> Any:
    """DeepSpeed's default for a typed field (through its alias too); null for a tabled key."""
    row = ROWS[path]
    canonical = row.alias_of or path
    if canonical not in FIELD_EFFECTS:
        return None
    section, name = canonical.rsplit(".", 1) if "." in canonical else ("", canonical)
    model: Any = ShardSpeedConfig
    for part in filter(None, section.split(".")):
        model, _ = _section_model(model.model_fields[part].annotation)
    return model.model_fields[name].get_default(call_default_factory=True)


_OFF_PATHS = sorted(
    p
    for p, r in ROWS.items()
    if r.status != "implemented" and (p in FIELD_EFFECTS or r.alias_of or p in IGNORED_KEYS or p in UNSUPPORTED_KEYS)
)


@pytest.mark.parametrize("path", _OFF_PATHS)
def test_non_implemented_keys_at_default_or_off_load_silently(path: str) -> None:
    """A DeepSpeed config that spells a key we lack only to leave it off (the default value, null) loads with no
    warning: ignoring it is what DeepSpeed does too."""
    assert load_config(_config(path, _off_value(path)), dp_world_size=1).warnings == []


@pytest.mark.parametrize("path", sorted(p for p in ROWS if p.endswith(".enabled") and ROWS[p].status != "implemented"))
def test_tabled_sections_switched_off_load_silently(path: str) -> None:
    assert load_config(_config(path, False), dp_world_size=1).warnings == []


@pytest.mark.parametrize("path", sorted(UNSUPPORTED_KEYS))
def test_refused_keys_name_the_missing_feature(path: str) -> None:
    on = _ON_VALUES.get(path, {"enabled": True})
    with pytest.raises(ConfigError) as error:
        load_config(_config(path, on), dp_world_size=1)
    assert str(error.value) == (
        f'"{path}" is a DeepSpeed option shardspeed does not support yet ({UNSUPPORTED_KEYS[path].feature}); '
        f"{UNSUPPORTED_KEYS[path].how_to_turn_off}"
    )


@pytest.mark.parametrize("path", sorted(IGNORED_KEYS))
def test_ignored_keys_warn_once_naming_the_feature(path: str) -> None:
    on = _ON_VALUES.get(path, {"enabled": True})
    warnings = load_config(_config(path, on), dp_world_size=1).warnings
    assert warnings == [f'"{path}" is ignored: shardspeed does not implement {IGNORED_KEYS[path].feature} yet']


_ON_VALUES: dict[str, Any] = {
    # A value that turns each feature on, where {"enabled": true} does not.
    "data_efficiency.data_routing": {"random_ltd": {"enabled": True}},  # DeepSpeed reads random_ltd.enabled alone
    "memory_breakdown": True,
    "dump_state": True,
    "disable_python_gc": True,
    "graph_harvesting": True,
    "disable_allgather": True,
    "zero_force_ds_cpu_optimizer": False,
    "timers": {"throughput": {"enabled": True}},
    "log_level": "info",
    "vocabulary_size": 50257,
    "fp16.fused_mode": True,
    "optimizer.legacy_fusion": True,
    "bf16.immediate_grad_update": True,
    "aio.io_backend": "posix",
    "aio.use_gds": True,
    "fp16.fp16_master_weights_and_grads": True,
    "bf16.check_grad_overflow": True,
    "bf16.check_overflow": True,
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}},
    "weight_quantization": {"quantized_initialization": {}},
    "gradient_allreduce_op": "sum",
    "sparse_gradients": True,
    "managed_gradient_accumulation": False,
    "sparse_attention": {"mode": "fixed"},
    "dataloader_drop_last": True,
    "compile": {"deepcompile": True},
    "moe": {"num_experts": 4},
    "use_data_before_expert_parallelism": True,
    "sequence_parallel_size": 2,
    "seq_parallel_comm_data_type": "bf16",
    "seq_parallel_communication_data_type": "bf16",
    "checkpoint": {"load_universal": True},
    "data_types.param_dtype": "bf16",
    "data_types.buffer_dtype": "bf16",
}
