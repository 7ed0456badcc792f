"""Where a trial's values go: the DeepSpeed config (dotted key paths, aliases) and the script's arguments. Pure.

A name starting with ``--`` is a script argument: an existing ``--name V`` / ``--name=V`` is replaced, else
``--name V`` is appended; a boolean value means a bare flag (true: present, false: removed), as argparse's
``store_true`` reads it. Any other name is a config key path (aliases first, ``space.ALIASES``). The path's
top-level section must be in the user's config (``optimizer.params.lr`` with no ``optimizer`` section is an
error, not a half-built optimizer); deeper missing levels are created.

Two aliases carry DeepSpeed's coupling between keys, so a searched value is the value training uses:
``lr`` also sets the scheduler's ``warmup_max_lr`` when the scheduler is WarmupLR / WarmupDecayLR (which drive the
lr to ``warmup_max_lr``, default 0.001, whatever the optimizer's lr), and ``batch_size`` (the micro-batch)
drops ``train_batch_size`` so the trial's global batch is inferred as micro x accumulation x world.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from shardspeed.autotuning.hpo.space import ALIASES, SpaceError

CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")
WARMUP_TO_MAX = ("WarmupLR", "WarmupDecayLR")


def config_path(name: str) -> tuple[str, ...] | None:
    """The config key path a parameter name sets, or None for a script argument."""
    if name.startswith("--"):
        return None
    return tuple(ALIASES.get(name, name).split("."))


def _set_path(config: dict[str, Any], path: tuple[str, ...], value: Any, name: str) -> None:
    if len(path) > 1 and path[0] not in config:
        raise SpaceError(
            f"params[{name!r}] sets {'.'.join(path)}, but the DeepSpeed config has no {path[0]!r} section: "
            f"add one (e.g. its 'type') so the trial's {path[0]} is defined"
        )
    node = config
    for depth, key in enumerate(path[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(path[: depth + 1])
            raise SpaceError(f"params[{name!r}] sets {'.'.join(path)}, but {where} is {child!r}, not a section")
        node = child
    node[path[-1]] = value


def apply_to_config(ds_config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``ds_config`` with every config-bound parameter set (script arguments are skipped)."""
    config = copy.deepcopy(dict(ds_config))
    for name, value in params.items():
        path = config_path(name)
        if path is None:
            continue
        _set_path(config, path, value, name)
        if name == "lr":
            scheduler = config.get("scheduler")
            if isinstance(scheduler, dict) and scheduler.get("type") in WARMUP_TO_MAX:
                scheduler.setdefault("params", {})["warmup_max_lr"] = value
        if name in ("batch_size", "micro_batch_size"):
            config.pop("train_batch_size", None)
    return config


def _render(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def apply_to_args(args: Sequence[str], params: Mapping[str, Any]) -> list[str]:
    """``args`` with every ``--name`` parameter substituted (config-bound parameters are skipped)."""
    out = list(args)
    for name, value in params.items():
        if not name.startswith("--"):
            continue
        kept: list[str] = []
        i = 0
        while i < len(out):
            word = out[i]
            if word == name:
                # ``--name V``: V is the flag's value unless it is the next option (a bare flag).
                takes_value = i + 1 < len(out) and not out[i + 1].startswith("--")
                i += 2 if takes_value else 1
                continue
            if word.startswith(name + "="):
                i += 1
                continue
            kept.append(word)
            i += 1
        if isinstance(value, bool):
            out = kept + ([name] if value else [])
        else:
            out = [*kept, name, _render(value)]
    return out


def split_config_arg(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the ``--deepspeed_config`` path, the other arguments): the trial gets its own config file."""
    rest: list[str] = []
    found: str | None = None
    i = 0
    while i < len(args):
        word = args[i]
        flag = next((f for f in CONFIG_FLAGS if word == f or word.startswith(f + "=")), None)
        if flag is None:
            rest.append(word)
            i += 1
            continue
        if word == flag:
            if i + 1 >= len(args):
                raise SpaceError(f"{flag} needs a path")
            found, i = args[i + 1], i + 2
        else:
            found, i = word.split("=", 1)[1], i + 1
    return found, rest
