"""Subcommands of the ``shardspeed`` command: a name → ``fn(argv) -> exit code`` registry.

Dispatch rule (also in ``shardspeed --help``): when the *first* command-line word is a registered subcommand
name, the rest of the command line goes to that subcommand; anything else is a launch, whose first positional
word is the training script. Subcommand names are lowercase words with dashes (``zero-to-fp32``): never a path
with ``/`` or an extension, so ``train.py`` or ``./estimate`` is always a script. To launch a script whose
file name equals a subcommand name, write it as a path (``./estimate``), or put ``--`` or any launcher option
first (``shardspeed -- estimate``, ``shardspeed --num_procs 2 estimate``).

A target may be a callable or an import path ``"package.module:function"``, imported only when the
subcommand runs, so registering e.g. a checkpoint converter costs the launcher nothing at start-up and cannot
create import cycles. New built-ins register at the bottom of this file.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from shardspeed.launcher.errors import LauncherError

SubcommandFunction = Callable[[list[str]], int]
SUBCOMMAND_NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


@dataclass(frozen=True)
class Subcommand:
    """A registered subcommand: its name, a one-line summary for ``--help``, and what to call."""

    name: str
    summary: str
    target: SubcommandFunction | str

    def resolve(self) -> SubcommandFunction:
        """The callable, importing it first when ``target`` is an import path."""
        if callable(self.target):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        function = getattr(importlib.import_module(module_name), attribute)
        if not callable(function):
            raise TypeError(f"subcommand {self.name!r}: {self.target!r} is not callable")
        return function


_SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(
    name: str, target: SubcommandFunction | str, summary: str = "", *, replace: bool = False
) -> None:
    """Register ``target`` (callable or ``"module:function"``) as ``shardspeed <name> ...``.

    A taken name is an error unless ``replace`` (two features must never silently shadow each other).
    """
    if not SUBCOMMAND_NAME_PATTERN.fullmatch(name):
        raise LauncherError(
            f"subcommand name {name!r} is invalid: use lowercase letters, digits and single dashes "
            "(e.g. 'zero-to-fp32'), so that it can never look like a script path"
        )
    if isinstance(target, str) and not re.fullmatch(r"[\w.]+:\w+", target):
        raise LauncherError(f"subcommand {name!r}: target {target!r} must be a callable or 'module:function'")
    if name in _SUBCOMMANDS and not replace:
        raise LauncherError(f"subcommand {name!r} is already registered (pass replace=True to override)")
    _SUBCOMMANDS[name] = Subcommand(name=name, summary=summary, target=target)


def unregister_subcommand(name: str) -> None:
    """Remove ``name`` from the registry (missing names are ignored). Mainly for tests."""
    _SUBCOMMANDS.pop(name, None)


def get_subcommand(name: str) -> Subcommand | None:
    """The subcommand registered as ``name``, or None."""
    return _SUBCOMMANDS.get(name)


def subcommands() -> list[Subcommand]:
    """All registered subcommands, sorted by name."""
    return [_SUBCOMMANDS[name] for name in sorted(_SUBCOMMANDS)]


# Built-ins. Later features add theirs here, e.g.
# register_subcommand("estimate", "shardspeed.zero.memory:estimate_main", "estimate memory per rank").
register_subcommand("help", "shardspeed.launcher.cli:help_command", "show launcher help, or a subcommand's help")
register_subcommand(
    "estimate", "shardspeed.zero.estimate:main", "estimate ZeRO model-state memory per GPU (e.g. --params 7.5B)"
)
register_subcommand(
    "zero-to-fp32", "shardspeed.checkpoint.consolidate:main", "write a checkpoint's fp32 weights as safetensors"
)
register_subcommand("report", "shardspeed.report:main", "plot a run's monitor logs into an HTML page (RUN_DIR)")
register_subcommand(
    "data-analyze", "shardspeed.data.analyzer.cli:main", "per-sample difficulty metric -> DeepSpeed's index files"
)
register_subcommand("hpo", "shardspeed.autotuning.hpo.cli:main", "hyper-parameter search with Optuna (--space FILE)")
