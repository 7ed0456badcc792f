"""Mixed-precision sections (``fp16``, ``bf16``) and the dtype names configs may use."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, Field

from .base import ConfigModel, NonNegativeFloat, PositiveFloat, PositiveInt, show

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: Any) -> torch.dtype | None:
    """A dtype name as DeepSpeed configs spell it (case-insensitive), a ``torch.dtype``, or None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES.values():
            return value
        raise ValueError(f"expected torch.float32, torch.float16 or torch.bfloat16, got {value}")
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    names = ", ".join(f'"{name}"' for name in _DTYPE_NAMES)
    raise ValueError(f"expected one of {names} (any case), got {show(value)}")


DtypeName = Annotated[torch.dtype | None, BeforeValidator(parse_dtype)]


class FP16Config(ConfigModel):
    """``fp16``: fp16 mixed precision with loss scaling (fp32 master weights)."""

    enabled: bool = False
    """Train in fp16 mixed precision. DeepSpeed default: false. Cannot be combined with ``bf16``."""

    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16. DeepSpeed default: false."""

    loss_scale: NonNegativeFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling. DeepSpeed default: 0 (dynamic)."""

    initial_scale_power: Annotated[int, Field(ge=0, le=127)] = 16
    """Dynamic scaling starts at ``2**initial_scale_power``. DeepSpeed default: 16. Capped at 127 so the
    starting scale is a finite fp32 number."""

    loss_scale_window: PositiveInt = 1000
    """Dynamic scaling doubles the scale after this many consecutive overflow-free steps.
    DeepSpeed default: 1000."""

    hysteresis: PositiveInt = 2
    """Dynamic scaling lowers the scale only after this many overflowing steps (delayed shift).
    DeepSpeed default: 2."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every overflow-free step, so only *consecutive* overflows lower the
    scale. DeepSpeed default: false."""

    min_loss_scale: PositiveFloat = 1.0
    """The dynamic scale never drops below this. DeepSpeed default: 1."""


class BF16Config(ConfigModel):
    """``bf16`` (legacy spelling ``bfloat16``): bf16 mixed precision; bf16's fp32-sized exponent range
    makes loss scaling unnecessary."""

    enabled: bool = False
    """Train in bf16 mixed precision. DeepSpeed default: false. Cannot be combined with ``fp16``."""
