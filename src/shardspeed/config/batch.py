"""Batch-size arithmetic: ``train_batch_size = micro_batch_per_gpu * grad_accum_steps * dp_world_size``.

DeepSpeed lets a config give any subset of the three keys and infers the rest. We follow its rules, but
where DeepSpeed floors a division and then fails a later assertion with the floored number, we say which
division was inexact and show every number involved.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .base import show
from .errors import ConfigError

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _positive_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {show(value)}")
    return value


def resolve_batch_sizes(
    train_batch_size: Any,
    train_micro_batch_size_per_gpu: Any,
    gradient_accumulation_steps: Any,
    dp_world_size: int,
    auto_keys: Collection[str] = (),
) -> BatchSizes:
    """Fill in whichever of the three batch keys are missing (None); check them when all are given.

    ``auto_keys`` names keys the config set to "auto" (already turned into None), only to explain an
    error. ``dp_world_size`` is the number of data-parallel ranks, i.e. the ranks a global batch is split
    over (not the total world size when other parallelism is used).
    """
    tbs = _positive_int(TBS, train_batch_size)
    micro = _positive_int(MICRO, train_micro_batch_size_per_gpu)
    gas = _positive_int(GAS, gradient_accumulation_steps)
    world = dp_world_size

    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            raise ConfigError(
                f"batch sizes disagree: {TBS} ({tbs}) must equal {MICRO} ({micro}) × {GAS} ({gas}) × "
                f"data-parallel world size ({world}) = {micro * gas * world}; fix one of them or leave "
                "one out to have it inferred"
            )
    elif tbs is not None and micro is not None:
        gas = _exact_quotient(tbs, micro * world, GAS, f"{MICRO} ({micro}) × data-parallel world size ({world})")
    elif tbs is not None and gas is not None:
        micro = _exact_quotient(tbs, gas * world, MICRO, f"{GAS} ({gas}) × data-parallel world size ({world})")
    elif micro is not None and gas is not None:
        tbs = micro * gas * world
    elif tbs is not None:
        gas = 1
        micro = _exact_quotient(tbs, world, MICRO, f"data-parallel world size ({world})")
    elif micro is not None:
        gas = 1
        tbs = micro * world
    else:
        given = f"only {GAS} ({gas}) is set" if gas is not None else "no batch size is set"
        autos = sorted(k for k in BATCH_KEYS if k in auto_keys)
        auto_note = f' ({", ".join(autos)}: "auto" counts as not set)' if autos else ""
        raise ConfigError(
            f"{given}{auto_note}: set {MICRO} (samples per rank per micro-step) and/or {TBS} (samples per "
            f"optimizer step across all data-parallel ranks); {GAS} is inferred when absent"
        )
    return BatchSizes(tbs, micro, gas)


def _exact_quotient(tbs: int, divisor: int, inferred_key: str, divisor_text: str) -> int:
    if tbs % divisor != 0:
        raise ConfigError(
            f"cannot infer {inferred_key}: {TBS} ({tbs}) is not divisible by {divisor_text} = {divisor}; "
            f"set {TBS} to a multiple of {divisor}"
        )
    return tbs // divisor
