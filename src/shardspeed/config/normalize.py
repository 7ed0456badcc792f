"""Key-level checks on the raw config dict, before any value is validated.

Walks the user's dict alongside the typed sections and, with full key paths in every message:
- unknown keys: within edit distance 2 of a key known at the same level (a typed field, an alias, a tabled
  DeepSpeed key) an error naming that key (a misspelling); farther from all of them one warning (someone else's
  key, e.g. a launcher's ``cuda_visible_devices``), see [Note: unknown keys];
- folds alias spellings (``bfloat16``, ``stage3_*``) into the canonical key, rejecting conflicting pairs;
- expands a bare bool where a section declares ``BOOL_MEANS`` (``"zero_optimization": true`` -> stage 1);
- resolves ``"auto"`` (the HF Trainer's placeholder) where a section allows it, rejects it elsewhere;
- drops DeepSpeed keys listed in ``keys.py``: ignored ones with a warning, unsupported ones with an error
  unless the value switches the feature off.
All problems found are reported together in one ConfigError.

[Note: unknown keys] DeepSpeed ignores unknown top-level keys and refuses unknown keys inside its pydantic
sections. Neither suits a port: refusing every unknown key breaks configs that carry a tool's own keys next to
DeepSpeed's, and ignoring them all lets ``"zero_optimisation": {...}`` train at stage 0 without a word. The
distance rule separates the two cases: a misspelling is a few edits from the key it meant, a foreign key is not.
The known keys include the DeepSpeed keys we do not implement (keys.py), so ``"tensorbord"`` is a misspelling of
an ignored key rather than a foreign key, and tabled sections with a fixed schema (``SECTION_KEYS``) get the same
check one level down.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from .base import ConfigModel, problems_message, show
from .errors import MISSPELLING_DISTANCE, ConfigError, misspelling_of
from .keys import IGNORED_KEYS, SECTION_KEYS, UNSUPPORTED_KEYS, KeyRule

AUTO = "auto"


@dataclass
class Normalized:
    """The config with canonical keys only, plus what the walk learned on the way."""

    data: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    auto_keys: set[str] = field(default_factory=set)
    """Canonical paths whose ``"auto"`` was dropped (batch keys: to be inferred; others: default)."""
    spellings: dict[str, str] = field(default_factory=dict)
    """Canonical path -> the path as the user spelled it, where they differ (for value errors)."""


def normalize(raw: Mapping[str, Any], model: type[ConfigModel]) -> Normalized:
    """Check and canonicalise the keys of ``raw`` for ``model``; one ConfigError lists every problem."""
    result = Normalized()
    problems: list[str] = []
    result.data = _section(raw, model, "", "", result, problems)
    if problems:
        raise ConfigError(problems_message(problems))
    return result


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _section(
    raw: Mapping[str, Any],
    model: type[ConfigModel],
    prefix: str,
    user_prefix: str,
    result: Normalized,
    problems: list[str],
) -> dict[str, Any]:
    """Normalize one section. ``prefix`` is its canonical path (tables are keyed by it); ``user_prefix``
    is the path as the user spelled it (messages use it)."""
    fields = {name: info for name, info in model.model_fields.items() if name not in model.INTERNAL_FIELDS}
    spelled: dict[str, list[tuple[str, Any]]] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{user_prefix or 'config'}: keys must be strings, got {key!r}")
            continue
        spelled.setdefault(model.KEY_ALIASES.get(key, key), []).append((key, value))

    out: dict[str, Any] = {}
    for canonical, spellings in spelled.items():
        path = _join(prefix, canonical)
        if canonical in model.AUTO_MEANS_DEFAULT and canonical in fields:
            given = [(key, value) for key, value in spellings if not _is_auto(value)]
            if not given:  # "auto" (possibly under both spellings) and no real value: resolve it
                result.auto_keys.add(path)
                _note_auto_default(fields[canonical], _join(user_prefix, spellings[0][0]), result)
                continue
            spellings = given  # "auto" under one spelling, a value under the other: the value wins
        if not _agree([value for _, value in spellings]):
            names = " and ".join(f'"{_join(user_prefix, key)}"' for key, _ in spellings)
            values = " vs ".join(show(value) for _, value in spellings)
            problems.append(f"{names} are two spellings of one option and disagree ({values}); keep one")
            continue
        key, value = spellings[0]
        user_path = _join(user_prefix, key)
        if canonical in model.AUTO_IS_VALUE and _is_auto(value):
            out[canonical] = value  # a real value of the field (pipeline.stages), not the HF placeholder
        elif canonical in fields:
            kept = _field_value(fields[canonical], value, path, user_path, result, problems)
            if kept is not _DROP:
                out[canonical] = kept
        elif path in IGNORED_KEYS or path in UNSUPPORTED_KEYS:
            _tabled(path, user_path, value, result, problems)
        elif canonical in model.INTERNAL_FIELDS:
            problems.append(f'"{user_path}" is not a config key: load_config fills it in')
        else:
            _unknown_key(key, user_path, _known_here(prefix, model), result, problems)
    return out


_DROP = object()
"""Marker: the key contributes nothing to the validated data (null section, or a problem was recorded)."""


def _field_value(
    info: FieldInfo, value: Any, path: str, user_path: str, result: Normalized, problems: list[str]
) -> Any:
    if user_path != path:
        result.spellings[path] = user_path
    section, optional = _section_model(info.annotation)
    if section is not None:
        if value is None:  # an explicit null section: absent (or None where the field allows it)
            return None if optional else _DROP
        if isinstance(value, bool) and section.BOOL_MEANS:  # DeepSpeed's legacy bare-bool section
            value = dict(section.BOOL_MEANS[value])
        if not isinstance(value, Mapping):
            problems.append(f"{user_path}: expected an object (a JSON dict), got {show(value)}")
            return _DROP
        return _section(value, section, path, user_path, result, problems)
    if _is_auto(value):
        problems.append(_auto_error(user_path, _value_hint(info.annotation)))
        return _DROP
    nested_autos = list(_nested_auto_paths(value, user_path))
    problems.extend(_auto_error(p, "set a number") for p in nested_autos)
    return _DROP if nested_autos else value


def _agree(values: list[Any]) -> bool:
    """Alias spellings given together must hold the same value (``5e8`` equals ``500000000``, but
    ``true`` does not equal ``1``)."""
    first = values[0]
    return all(v == first and isinstance(v, bool) == isinstance(first, bool) for v in values[1:])


def _section_model(annotation: Any) -> tuple[type[ConfigModel] | None, bool]:
    """(section class, may be null) when the field holds a nested section, else (None, False)."""
    if isinstance(annotation, type) and issubclass(annotation, ConfigModel):
        return annotation, False
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], ConfigModel):
            return members[0], True
    return None, False


def _value_hint(annotation: Any) -> str:
    members = set(get_args(annotation)) if get_origin(annotation) in (Union, types.UnionType) else {annotation}
    members.discard(type(None))
    if members == {bool}:
        return "set true or false"
    if members and members <= {int, float}:
        return "set a number"
    return "set a value"


def _auto_error(user_path: str, hint: str) -> str:
    return f'"{user_path}" is "auto", which only the HF Trainer can fill in; {hint}'


def _nested_auto_paths(value: Any, path: str) -> list[str]:
    """Paths of ``"auto"`` leaves inside a free-form value (optimizer/scheduler ``params``)."""
    if _is_auto(value):
        return [path]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _nested_auto_paths(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _nested_auto_paths(v, f"{path}[{i}]")]
    return []


def _note_auto_default(info: FieldInfo, user_path: str, result: Normalized) -> None:
    """Batch keys set to "auto" are inferred (no note needed); other keys fall back to the default."""
    if not info.is_required():
        result.warnings.append(
            f'"{user_path}" is "auto": using DeepSpeed\'s default {show(info.default)} (shardspeed does not '
            "size it from the model the way the HF Trainer does)"
        )


def _tabled(path: str, user_path: str, value: Any, result: Normalized, problems: list[str]) -> None:
    """A DeepSpeed key shardspeed does not implement: check its contents' names where DeepSpeed fixes them, then
    warn (ignored) or refuse (unsupported) unless the value leaves the feature off."""
    _check_section_keys(path, user_path, value, result, problems)
    ignored = path in IGNORED_KEYS
    rule: KeyRule = IGNORED_KEYS[path] if ignored else UNSUPPORTED_KEYS[path]
    if rule.is_off(value):
        return
    if ignored:
        result.warnings.append(f'"{user_path}" is ignored: shardspeed does not implement {rule.feature} yet')
    else:
        problems.append(
            f'"{user_path}" is a DeepSpeed option shardspeed does not support yet ({rule.feature}); '
            f"{rule.how_to_turn_off}"
        )


def _check_section_keys(path: str, user_path: str, value: Any, result: Normalized, problems: list[str]) -> None:
    """The misspelling rule inside a tabled section whose keys DeepSpeed fixes (``SECTION_KEYS``), recursively."""
    known = SECTION_KEYS.get(path)
    if known is None or not isinstance(value, Mapping):
        return
    for key, inner in value.items():
        if not isinstance(key, str):
            problems.append(f"{user_path}: keys must be strings, got {key!r}")
        elif key in known:
            _check_section_keys(f"{path}.{key}", f"{user_path}.{key}", inner, result, problems)
        else:
            _unknown_key(key, f"{user_path}.{key}", known, result, problems)


def _known_here(prefix: str, model: type[ConfigModel]) -> list[str]:
    """Every key a config may hold at ``prefix``: typed fields, their aliases, and tabled DeepSpeed keys."""
    fields = [name for name in model.model_fields if name not in model.INTERNAL_FIELDS]
    tabled = [p.rsplit(".", 1)[-1] for p in (*IGNORED_KEYS, *UNSUPPORTED_KEYS) if p.rpartition(".")[0] == prefix]
    return sorted({*fields, *model.KEY_ALIASES, *tabled})


def _unknown_key(key: str, user_path: str, known: Any, result: Normalized, problems: list[str]) -> None:
    """A misspelling of a known key is an error naming it; any other unknown key is one warning (see
    [Note: unknown keys])."""
    meant = misspelling_of(key, known)
    if meant is not None:
        problems.append(f'unknown key "{user_path}" (did you mean "{meant}"?)')
        return
    result.warnings.append(
        f'unknown key "{user_path}" is ignored: it is not a DeepSpeed key shardspeed knows, nor within '
        f"{MISSPELLING_DISTANCE} edits of one"
    )
