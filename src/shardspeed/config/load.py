"""``load_config``: DeepSpeed-style config (dict, JSON file or None) -> validated ``ShardSpeedConfig``.

Pipeline, each stage raising one ConfigError that lists all the problems it found:
1. read the source (file errors name the file, JSON errors the line and column);
2. ``normalize``: key names (unknown keys, aliases, "auto", DeepSpeed keys we ignore or reject);
3. ``resolve_batch_sizes``: infer the missing batch keys for the data-parallel world size;
4. pydantic: value types and ranges, plus each section's cross-field rules; its errors are rewritten
   with our key paths (never shown raw); then ``effects.py``: keys set to a value with no effect here warn
   (once, in ``warnings``) or are refused;
5. the optimizer and scheduler modules check their own ``params``.

It is a pure function of ``(config, dp_world_size)``: every rank that parses the same config gets the
same result or the same error, before any collective runs, so a bad config can never hang a job.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .base import InvalidValue, problems_message, show
from .batch import GAS, MICRO, TBS, resolve_batch_sizes
from .effects import check_field_effects
from .errors import ConfigError
from .normalize import normalize
from .root import ShardSpeedConfig
from .zero import without_inert_offload_param

ConfigSource = Mapping[str, Any] | str | os.PathLike[str] | None


def load_config(config: ConfigSource, *, dp_world_size: int) -> ShardSpeedConfig:
    """Parse and validate a DeepSpeed-compatible config for ``dp_world_size`` data-parallel ranks.

    ``config`` is a dict (not modified), a path to a JSON file, or None (same as ``{}``, which fails for
    lack of a batch size). Raises ConfigError naming the key path, the bad value and what is expected.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size: expected a positive integer, got {dp_world_size!r}")
    normalized = normalize(read_config_source(config), ShardSpeedConfig)
    data = normalized.data
    batch = resolve_batch_sizes(data.get(TBS), data.get(MICRO), data.get(GAS), dp_world_size, normalized.auto_keys)
    data.update(
        {
            TBS: batch.train_batch_size,
            MICRO: batch.train_micro_batch_size_per_gpu,
            GAS: batch.gradient_accumulation_steps,
            "dp_world_size": dp_world_size,
            "warnings": normalized.warnings,
        }
    )
    try:
        parsed = ShardSpeedConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, normalized.spellings)) from None
    zero, offload_note = without_inert_offload_param(parsed.zero_optimization)
    if offload_note is not None:
        parsed = parsed.model_copy(update={"zero_optimization": zero, "warnings": [*parsed.warnings, offload_note]})
    warnings, problems = check_field_effects(parsed)
    if problems:
        raise ConfigError(problems_message(problems))
    if warnings:
        parsed = parsed.model_copy(update={"warnings": [*parsed.warnings, *warnings]})
    return _with_validated_params(parsed)


def read_config_source(config: ConfigSource) -> dict[str, Any]:
    """The config as a fresh dict: from a mapping (deep-copied), a JSON file, or None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return _read_json_file(Path(config))
    raise ConfigError(f"config: expected a dict, a path to a JSON file, or None, got a {type(config).__name__}")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON silently keeps the last of two equal keys; a config with both is almost always a mistake."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _read_json_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        looks_like_json = str(path).lstrip().startswith("{")
        hint = " (it looks like JSON text: pass json.loads(text) instead)" if looks_like_json else ""
        raise ConfigError(f"config file {path} does not exist{hint}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"config file {path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    except _DuplicateKey as duplicate:
        raise ConfigError(
            f'config file {path} has the key "{duplicate.key}" twice in one object; JSON would keep only '
            "the last one, so remove the other"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object ({{...}}), got {show(data)}")
    return data


_EXPECTED: dict[str, str] = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "string_too_short": "a non-empty string",
    "list_type": "a list",
    "dict_type": "an object (a JSON dict)",
    "model_type": "an object (a JSON dict)",
    "model_attributes_type": "an object (a JSON dict)",
}
_BOUNDS: dict[str, tuple[str, str]] = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def describe_validation_error(error: ValidationError, spellings: Mapping[str, str]) -> str:
    """Pydantic's errors as our messages: ``<key path>: expected <what>, got <value>``, one per line.

    ``spellings`` maps canonical paths to the alias the user wrote, so messages use the user's words.
    """
    lines = []
    for item in error.errors(include_url=False):
        path = _loc_path(item["loc"])
        cause = (item.get("ctx") or {}).get("error")
        kind = item["type"]
        if isinstance(cause, InvalidValue):
            full = f"{path}.{cause.key}" if path else cause.key
            lines.append(InvalidValue.render(spellings.get(full, full), cause.problem))
            continue
        where = spellings.get(path, path) or "config"
        if kind in ("value_error", "assertion_error"):
            lines.append(f"{where}: {cause}")
        elif kind == "missing":
            lines.append(f"{where}: required key is missing")
        elif kind == "extra_forbidden":
            lines.append(f'unknown key "{where}"')
        else:
            lines.append(f"{where}: expected {_expected(kind, item)}, got {show(item.get('input'))}")
    return problems_message(lines)


def _expected(kind: str, item: Mapping[str, Any]) -> str:
    ctx = item.get("ctx") or {}
    if kind in _BOUNDS:
        name, symbol = _BOUNDS[kind]
        bound = ctx.get(name)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # "> 0", not "> 0.0": float fields get float bounds
        return f"a number {symbol} {bound}"
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind == "is_instance_of":
        return f"a {ctx.get('class')}"
    return _EXPECTED.get(kind, str(item.get("msg", "a valid value")).lower())


def _loc_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else part
    return path


def _with_validated_params(config: ShardSpeedConfig) -> ShardSpeedConfig:
    """Let the optimizer and scheduler modules check their ``params`` (they know each type's arguments).

    Imported here, not at module level: those modules import ``shardspeed.config`` for ConfigError.
    """
    from shardspeed.optim import validate_optimizer_params
    from shardspeed.schedulers import validate_scheduler_params

    updates: dict[str, Any] = {}
    for name, section, validate in (
        ("optimizer", config.optimizer, validate_optimizer_params),
        ("scheduler", config.scheduler, validate_scheduler_params),
    ):
        if section is not None:
            params = _call_params_validator(validate, section.type, section.params, f"{name}.params", name)
            updates[name] = section.model_copy(update={"params": params})
    return config.model_copy(update=updates) if updates else config


def _call_params_validator(
    validate: Callable[..., dict[str, Any]], type_name: str, params: dict[str, Any], path: str, section: str
) -> dict[str, Any]:
    """Call the module's validator on a copy; make sure its error names the key path."""
    try:
        validated = validate(type_name, copy.deepcopy(params), path=path)
    except ConfigError as error:
        message = str(error)
        if not message.startswith(section):
            message = f"{path}: {message}"
        raise ConfigError(message) from None
    return dict(validated)
