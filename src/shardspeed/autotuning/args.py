"""A trial's script arguments: DeepSpeed's ``arg_mappings`` put config values on the script's command line (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardspeed.autotuning.space import AC_ARG, Point

__all__ = ["script_args_for"]


def script_args_for(
    base: Sequence[str], config: dict[str, Any], point: Point, arg_mappings: dict[str, str] | None
) -> list[str]:
    """DeepSpeed's ``arg_mappings``: each mapped config key's value goes to the script as ``FLAG VALUE`` (replacing
    the flag where the script arguments have it); ``activation_checkpointing`` maps to a bare flag (pure)."""
    args = list(base)
    for key, flag in (arg_mappings or {}).items():
        key = key.strip()
        if key == AC_ARG:
            if point.checkpoint_activations and flag not in args:
                args.append(flag)
            continue
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            continue
        if flag in args:
            index = args.index(flag)
            args[index : index + 2] = [flag, str(value)]
        else:
            args += [flag, str(value)]
    return args
