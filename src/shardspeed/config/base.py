"""The base every config section derives from, and the value types the sections share.

Division of labour (see ``load.py``): ``normalize.py`` checks key *names* (unknown keys, aliases, "auto",
DeepSpeed options we ignore or reject) on the raw dict, with full key paths; pydantic then checks *values*
against the typed sections defined here and in the sibling modules; ``load.py`` turns pydantic's errors
into one :class:`ConfigError`. ``extra="forbid"`` below is only a safety net for code that builds a
section directly: user configs never reach pydantic with an unknown key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class InvalidValue(ValueError):
    """Raised by a section's model-level validator about one of its keys.

    A field validator's error already carries the field's location; a model-level check (one that looks
    at several fields) does not, so it names the key here and ``load.py`` appends it to the section path.
    ``problem`` may contain ``{path}`` where the full key path belongs; otherwise it is prefixed with it.
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(self.render(key, problem))
        self.key = key
        self.problem = problem

    @staticmethod
    def render(path: str, problem: str) -> str:
        if "{path}" in problem:
            return problem.replace("{path}", path)
        return f"{path}: {problem}"


def problems_message(problems: Sequence[str]) -> str:
    """One ConfigError message for every problem a parsing stage found (not just the first)."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)


def show(value: Any, limit: int = 80) -> str:
    """A value as the user wrote it in JSON (``true``, ``"cpu"``, ``5e8`` -> ``500000000.0``), shortened."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _integral_float_to_int(value: Any) -> Any:
    """JSON has one number type and configs write sizes as ``5e8``: accept floats with no fraction."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An integer; ``1e9`` (a float with no fractional part) is accepted and becomes ``1000000000``."""
PositiveInt = Annotated[int, BeforeValidator(_integral_float_to_int), Field(gt=0)]
NonNegativeInt = Annotated[int, BeforeValidator(_integral_float_to_int), Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class ConfigModel(BaseModel):
    """A config section: typed, immutable, strict (``"true"`` is not a bool, ``true`` is not a number).

    Strictness is deliberate: DeepSpeed's lax parsing turns ``"false"`` into ``False`` and ``1`` into
    ``True``, which hides generated-config bugs. NaN/inf are rejected for every float for the same reason
    (Python's json module reads ``NaN`` and ``Infinity``).
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        arbitrary_types_allowed=True,  # torch.dtype fields
    )

    KEY_ALIASES: ClassVar[Mapping[str, str]] = {}
    """Other spellings DeepSpeed accepts for a key in this section: alias -> canonical field name."""

    AUTO_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset()
    """Fields where the HF-Trainer placeholder ``"auto"`` is resolved by dropping the key (the default
    applies, or for batch sizes: inferred from the others). ``"auto"`` anywhere else is an error."""

    AUTO_IS_VALUE: ClassVar[frozenset[str]] = frozenset()
    """Fields where ``"auto"`` is a real value of DeepSpeed's (``pipeline.stages``: the module decides), passed to
    the field as is, with no note."""

    INTERNAL_FIELDS: ClassVar[frozenset[str]] = frozenset()
    """Fields filled in by ``load_config``, never read from the user's config."""

    BOOL_MEANS: ClassVar[Mapping[bool, Mapping[str, Any]]] = {}
    """Where DeepSpeed accepts a bare bool for this whole section: the section it stands for
    (``"zero_optimization": true`` is ``{"stage": 1}``). Empty: a bool is an error like any non-object."""
