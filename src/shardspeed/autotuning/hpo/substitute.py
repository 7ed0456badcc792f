"""Where a trial's values go: the DeepSpeed config (dotted key paths, aliases) and the script's arguments. Pure.

A name starting with ``--`` is a script argument: an existing ``--name V`` / ``--name=V`` is replaced, else
``--name V`` is appended; a boolean value means a bare flag (true: present, false: removed), as argparse's
``store_true`` reads it. Any other name is a config key path (aliases first, ``space.ALIASES``). The path's
top-level section must be in the user's config (``optimizer.params.lr`` with no ``optimizer`` section is an
error, not a half-built optimizer); deeper missing levels are created.

DeepSpeed couples some keys; the couplings are keyed on the resolved path, so an alias and its dotted form act
alike, and a searched value is the value training uses:

- ``optimizer.params.lr`` also sets the scheduler's ``warmup_max_lr`` when the scheduler is WarmupLR /
  WarmupDecayLR (which drive the lr to ``warmup_max_lr``, default 0.001, whatever the optimizer's lr). OneCycle and
  LRRangeTest set the lr from their own keys, so searching the optimizer's lr under them is a ``SpaceError``
  naming the scheduler key to search instead (trials that cannot differ are never launched).
- The batch triple ``train_batch_size`` = micro-batch x ``gradient_accumulation_steps`` x data-parallel ranks
  ([Note: batch couplings]): searching the micro-batch or the accumulation keeps the other of the two as the
  user's config has it (written, or inferred from ``train_batch_size`` with the trial's ``num_procs``) and drops
  ``train_batch_size``, which is then inferred; searching ``train_batch_size`` keeps the micro-batch and drops the
  accumulation. So every trial's triple is consistent, and a key the user set that is not searched keeps its value
  (an inferred accumulation is pinned, not lost).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from shardspeed.autotuning.hpo.space import ALIASES, SpaceError

CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")
WARMUP_TO_MAX = ("WarmupLR", "WarmupDecayLR")
LR_PATH = ("optimizer", "params", "lr")
OWN_LR_KEY = {"OneCycle": "scheduler.params.cycle_max_lr", "LRRangeTest": "scheduler.params.lr_range_test_min_lr"}
"""Schedulers that set the lr from their own keys: the key to search instead of the optimizer's lr."""
TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


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


def apply_to_config(
    ds_config: Mapping[str, Any], params: Mapping[str, Any], num_procs: int | None = None
) -> dict[str, Any]:
    """A deep copy of ``ds_config`` with every config-bound parameter set (script arguments are skipped) and
    DeepSpeed's couplings applied (module docstring); ``num_procs`` lets an inferred accumulation be pinned."""
    config = copy.deepcopy(dict(ds_config))
    searched: set[str] = set()
    for name, value in params.items():
        path = config_path(name)
        if path is None:
            continue
        _set_path(config, path, value, name)
        if path == LR_PATH:
            _couple_lr(config, value, name)
        if len(path) == 1 and path[0] in (TBS, MICRO, GAS):
            searched.add(path[0])
    if searched:
        _couple_batch(config, ds_config, searched, num_procs)
    return config


def _couple_lr(config: dict[str, Any], value: Any, name: str) -> None:
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict):
        return
    kind = scheduler.get("type")
    if kind in WARMUP_TO_MAX:
        scheduler.setdefault("params", {})["warmup_max_lr"] = value
    elif kind in OWN_LR_KEY:
        raise SpaceError(
            f"params[{name!r}] sets optimizer.params.lr, but the {kind} scheduler sets the lr from its own keys: "
            f"search {OWN_LR_KEY[kind]!r} instead"
        )


def user_batch(ds_config: Mapping[str, Any], num_procs: int | None) -> dict[str, int]:
    """The user's micro-batch and accumulation, as written or as DeepSpeed infers them from ``train_batch_size``
    over ``num_procs`` ranks (only where the division is exact; unknown keys are left out)."""
    written = {key: ds_config[key] for key in (TBS, MICRO, GAS) if isinstance(ds_config.get(key), int)}
    out = {key: written[key] for key in (MICRO, GAS) if key in written}
    total = written.get(TBS)
    if total is None or not num_procs:
        return out
    if MICRO in out and GAS not in out and total % (out[MICRO] * num_procs) == 0:
        out[GAS] = total // (out[MICRO] * num_procs)
    elif GAS in out and MICRO not in out and total % (out[GAS] * num_procs) == 0:
        out[MICRO] = total // (out[GAS] * num_procs)
    elif not out and total % num_procs == 0:
        out = {MICRO: total // num_procs, GAS: 1}
    return out


def _couple_batch(
    config: dict[str, Any], ds_config: Mapping[str, Any], searched: set[str], num_procs: int | None
) -> None:
    """[Note: batch couplings] Keep the batch key the user set that is not searched, drop the one to infer."""
    if searched == {TBS, MICRO, GAS}:
        return
    if TBS in searched:
        if len(searched) == 2:  # the third key is inferred
            config.pop(({MICRO, GAS} - searched).pop(), None)
        elif MICRO in config:  # the user's micro-batch stays, the accumulation is inferred
            config.pop(GAS, None)
        return
    config.pop(TBS, None)
    kept = ({MICRO, GAS} - searched).pop() if len(searched) == 1 else None
    if kept is not None and kept not in config:
        inferred = user_batch(ds_config, num_procs).get(kept)
        if inferred is not None:
            config[kept] = inferred


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
