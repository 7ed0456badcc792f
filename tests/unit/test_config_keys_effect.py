"""Every key of the typed config acts, warns once, or is refused — as ``config/effects.py`` declares.

The table must name every field (a field added without an entry fails here), and each warn / refuse entry is
exercised with its example value: a warning naming the key exactly once, or a ConfigError naming the key and the
missing feature. Before this table, ~20 of these keys (``override_module_apply``, ``leaf_module``,
``round_robin_gradients``…) were accepted with no effect and no word.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.config import ConfigError, ShardSpeedConfig, load_config
from shardspeed.config.effects import FIELD_EFFECTS
from shardspeed.config.normalize import _section_model
from shardspeed.zero.stage3.plan import plan_units


def _field_paths(model: type, prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        if name in model.INTERNAL_FIELDS:
            continue
        path = f"{prefix}.{name}" if prefix else name
        section, _ = _section_model(info.annotation)
        paths += _field_paths(section, path) if section is not None else [path]
    return paths


def _nested(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _load(path: str, value: Any) -> ShardSpeedConfig:
    config = {"train_micro_batch_size_per_gpu": 1, **_nested(path, value)}
    if path.startswith("zero_optimization."):
        config["zero_optimization"] = {"stage": 3, **config["zero_optimization"]}
    return load_config(config, dp_world_size=1)


def test_every_field_has_a_declared_effect() -> None:
    assert sorted(FIELD_EFFECTS) == sorted(_field_paths(ShardSpeedConfig))


def _entries(kind: str, **extra: Any) -> list[str]:
    return [p for p, e in FIELD_EFFECTS.items() if e.kind == kind and all(getattr(e, k) == v for k, v in extra.items())]


@pytest.mark.parametrize("path", _entries("warns"))
def test_warns_exactly_once(path: str) -> None:
    effect = FIELD_EFFECTS[path]
    warnings = _load(path, effect.example).warnings
    assert [w for w in warnings if f'"{path}"' in w] == [w for w in warnings]  # nothing else warned
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f'"{path}" = ') and "has no effect in shardspeed" in warnings[0]
    assert effect.why in warnings[0]


@pytest.mark.parametrize("path", _entries("refused"))
def test_refused_with_the_reason(path: str) -> None:
    effect = FIELD_EFFECTS[path]
    with pytest.raises(ConfigError) as error:
        _load(path, effect.example)
    message = str(error.value)
    assert f'"{path}' in message and "shardspeed does not support yet" in message
    if not effect.by_validator:
        assert effect.why in message


@pytest.mark.parametrize("path", [p for p, e in FIELD_EFFECTS.items() if e.kind != "acts"])
def test_default_value_is_silent(path: str) -> None:
    """A config that spells out DeepSpeed's default (as generated configs do) gets no warning and no error."""
    section, name = path.rsplit(".", 1) if "." in path else ("", path)
    model: Any = ShardSpeedConfig
    for part in filter(None, section.split(".")):
        model, _ = _section_model(model.model_fields[part].annotation)
    default = model.model_fields[name].get_default(call_default_factory=True)
    assert _load(path, default).warnings == []


def test_acts_entries_say_where() -> None:
    for path in _entries("acts"):
        assert FIELD_EFFECTS[path].why, path


def test_leaf_module_accepts_deepspeeds_schema() -> None:
    leaf = _load("zero_optimization.leaf_module", {"classes": "MoE", "name_suffixes": ["mlp"]})
    assert leaf.zero_optimization.leaf_module.classes == ["MoE"]
    assert leaf.zero_optimization.leaf_module.name_suffixes == ["mlp"]
    with pytest.raises(ConfigError, match=r'leaf_module\.name" \(did you mean "names"'):
        _load("zero_optimization.leaf_module", {"name": ["x"]})


class _Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))


def test_model_persistence_threshold_caps_the_persistent_unit() -> None:
    """Biases (4 elements each) are persistent under a threshold of 4; a cap of 8 keeps only the first two."""
    plan = plan_units(_Three(), 4)
    assert plan.units[plan.persistent].param_names == ["a.bias", "b.bias", "c.bias"]
    capped = plan_units(_Three(), 4, model_cap=8)
    assert capped.units[capped.persistent].param_names == ["a.bias", "b.bias"]
    assert capped.units[capped.owner["c.bias"]].name == "c"  # partitioned with its module's weight
    assert plan_units(_Three(), 4, model_cap=3).persistent is None
