"""Which ``optimizer.type`` names exist, and what each one means.

DeepSpeed resolves the name in two tiers and so do we: its own names first (matched case-insensitively:
``Adam``, ``AdamW``, ``Lamb``, ``Lion``, ``Adagrad``), then any ``torch.optim`` class by name. We also match
torch names case-insensitively (DeepSpeed does not), because ``"sgd"`` has exactly one sensible meaning.
DeepSpeed's own names win over torch's: ``"Adam"`` means DeepSpeed's Adam (decoupled weight decay by
default), not ``torch.optim.Adam``; see ``shardspeed.optim.specs``.
"""

from __future__ import annotations

import functools
import inspect

import torch

from shardspeed.config.errors import ConfigError, did_you_mean
from shardspeed.optim.compressed_types import COMPRESSED_TYPES

DEEPSPEED_TYPES: tuple[str, ...] = ("Adam", "AdamW", "Lamb", "Lion")
"""Types whose parameters and defaults we define ourselves to match DeepSpeed (not torch's defaults)."""

NOT_SUPPORTED_YET: dict[str, str] = {
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
    # DeepSpeed's "Muon" is its own hybrid (Muon for matrices, Adam for the rest); torch.optim.Muon only
    # accepts 2-D parameters, so mapping the name onto it would silently change meaning.
    "muon": "Muon",
}
"""DeepSpeed optimizer types we recognise but do not implement (communication-compressed or muP variants)."""

_EXCLUDED_TORCH_CLASSES: dict[str, str] = {
    "LBFGS": "it re-evaluates the loss through a closure several times per step; engine.step() cannot",
}


@functools.cache
def torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every concrete optimizer class exported by ``torch.optim`` that a config may name."""
    classes: dict[str, type[torch.optim.Optimizer]] = {}
    for name in dir(torch.optim):
        candidate = getattr(torch.optim, name)
        if (
            inspect.isclass(candidate)
            and issubclass(candidate, torch.optim.Optimizer)
            and candidate is not torch.optim.Optimizer
            and name.lower() not in NOT_SUPPORTED_YET
            and name not in _EXCLUDED_TORCH_CLASSES
        ):
            classes[name] = candidate
    return classes


def known_optimizer_names() -> list[str]:
    """All names ``optimizer.type`` accepts, in their canonical spelling."""
    names = list(DEEPSPEED_TYPES) + list(COMPRESSED_TYPES)  # compressed: optim/compressed_types.py
    names += [name for name in torch_optimizer_classes() if name.lower() not in {n.lower() for n in names}]
    return names


def canonical_optimizer_name(type_name: object, path: str = "optimizer.type") -> str:
    """The canonical spelling of an ``optimizer.type`` value (``"adamw"`` -> ``"AdamW"``).

    Raises ConfigError for a non-string, a DeepSpeed type we do not implement, an excluded torch class,
    or an unknown name (with the nearest valid one).
    """
    if not isinstance(type_name, str):
        raise ConfigError(f"{path} must be a string naming an optimizer, got {type_name!r}")
    lowered = type_name.lower()
    for name in known_optimizer_names():
        if name.lower() == lowered:
            return name
    if lowered in NOT_SUPPORTED_YET:
        raise ConfigError(
            f'{path} "{type_name}": DeepSpeed\'s {NOT_SUPPORTED_YET[lowered]} is not supported yet; '
            f"supported types: {', '.join(known_optimizer_names())}"
        )
    for excluded, why in _EXCLUDED_TORCH_CLASSES.items():
        if excluded.lower() == lowered:
            raise ConfigError(f'{path} "{type_name}" is not supported: {why}')
    known = known_optimizer_names()
    raise ConfigError(
        f'{path} "{type_name}" is not a known optimizer{did_you_mean(type_name, known)}; '
        f"supported types: {', '.join(known)}"
    )
