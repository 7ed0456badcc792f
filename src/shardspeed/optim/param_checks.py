"""Value checks for the ``params`` dicts of the optimizer and scheduler config sections.

Both sections are free-form dicts in DeepSpeed's JSON (they are splatted into a constructor), so DeepSpeed
reports a typo as a ``TypeError`` deep inside ``initialize`` — or not at all when a default silently applies.
We check them once, at the config boundary, against a small spec per type: every key known, every value
of the right kind and range, defaults filled in. Every error names the full key path and the bad value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardspeed.config.errors import ConfigError, did_you_mean

Check = Callable[[Any, str], Any]
"""A check takes (value, key path) and returns the normalized value, or raises ConfigError."""


class _Absent:
    """Default marker: the key stays out of the normalized dict when the user leaves it out."""

    def __repr__(self) -> str:
        return "ABSENT"


REQUIRED: Any = object()
ABSENT: Any = _Absent()


@dataclass(frozen=True)
class ParamSpec:
    """One accepted key: how to check its value and what to use when it is missing."""

    check: Check
    default: Any = ABSENT


def _describe(value: Any) -> str:
    """The bad value as the user wrote it, plus a hint for HF's unresolved "auto" placeholders."""
    if value == "auto":
        return (
            '"auto" ("auto" is filled in by the Hugging Face Trainer/Accelerate integration before the '
            "config reaches the engine; give a concrete value here)"
        )
    return repr(value)


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but `"lr": true` is a mistake, never a learning rate.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(
    value: Any,
    path: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> float:
    """A finite int or float (not a bool) within the given bounds, returned as float."""
    if not _is_number(value) or not math.isfinite(value):
        raise ConfigError(f"{path} must be a number, got {_describe(value)}")
    low_ok = minimum is None or (value > minimum if exclusive_minimum else value >= minimum)
    high_ok = maximum is None or (value < maximum if exclusive_maximum else value <= maximum)
    if not (low_ok and high_ok):
        bounds = []
        if minimum is not None:
            bounds.append(f"{'>' if exclusive_minimum else '>='} {minimum}")
        if maximum is not None:
            bounds.append(f"{'<' if exclusive_maximum else '<='} {maximum}")
        raise ConfigError(f"{path} must be {' and '.join(bounds)}, got {value!r}")
    return float(value)


def check_int(value: Any, path: str, *, minimum: int | None = None) -> int:
    """An integer (an integral float such as 1e3 from JSON is accepted) of at least ``minimum``."""
    if _is_number(value) and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path} must be an integer, got {_describe(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{path} must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(value: Any, path: str) -> bool:
    """A real JSON boolean: the string "false" is truthy in Python, so strings are refused."""
    if not isinstance(value, bool):
        raise ConfigError(f"{path} must be true or false, got {_describe(value)}")
    return value


def check_choice(value: Any, path: str, *, choices: Sequence[str]) -> str:
    """One of a fixed set of strings."""
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(f'"{c}"' for c in choices)
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ConfigError(f"{path} must be one of {allowed}, got {_describe(value)}{hint}")
    return value


def check_number_tuple(
    value: Any,
    path: str,
    *,
    length: int,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_maximum: bool = False,
    allow_none: bool = False,
) -> tuple[float | None, ...]:
    """A JSON list (or tuple) of ``length`` numbers, such as Adam's ``betas``; returned as a tuple."""
    if not isinstance(value, (list, tuple)) or len(value) != length:
        raise ConfigError(f"{path} must be a list of {length} numbers, got {_describe(value)}")
    items: list[float | None] = []
    for index, item in enumerate(value):
        if item is None and allow_none:
            items.append(None)
            continue
        items.append(
            check_number(
                item,
                f"{path}[{index}]",
                minimum=minimum,
                maximum=maximum,
                exclusive_maximum=exclusive_maximum,
            )
        )
    return tuple(items)


def check_number_or_list(value: Any, path: str, *, minimum: float | None = None) -> float | list[float]:
    """One number for every param group, or a list with one number per group (length checked at build)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{path} must be a number or a non-empty list of numbers, got []")
        return [check_number(item, f"{path}[{i}]", minimum=minimum) for i, item in enumerate(value)]
    return check_number(value, path, minimum=minimum)


def optional(check: Check) -> Check:
    """Wrap a check so that JSON null is also accepted (meaning "derive it", e.g. from another key)."""

    def check_or_none(value: Any, path: str) -> Any:
        return None if value is None else check(value, path)

    return check_or_none


def validate_params(params: Any, spec: Mapping[str, ParamSpec], path: str) -> dict[str, Any]:
    """Check ``params`` against ``spec``: refuse unknown keys (naming the nearest valid one), check every
    value, and fill in defaults. Returns a new dict; the input is not modified."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{path} must be a JSON object (dict), got {_describe(params)}")
    for key in params:
        if key not in spec:
            valid = ", ".join(sorted(spec))
            raise ConfigError(
                f"{path}.{key} is not a known parameter{did_you_mean(str(key), spec)}; valid keys: {valid}"
            )
    normalized: dict[str, Any] = {}
    for key, param_spec in spec.items():
        if key in params:
            normalized[key] = param_spec.check(params[key], f"{path}.{key}")
        elif param_spec.default is REQUIRED:
            raise ConfigError(f"{path}.{key} is required")
        elif param_spec.default is not ABSENT:
            normalized[key] = param_spec.default
    return normalized
