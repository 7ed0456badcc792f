"""``shardspeed --autotuning tune|run [launcher options] script.py ... --deepspeed_config cfg.json`` (DeepSpeed's
launcher flag): ``tune`` runs the tuner (autotuning/tune.py) and writes ``results_dir``; ``run`` tunes unless
``results_dir`` already holds ``ds_config_optimal.json`` from a tune of the same config (``overwrite: false``), then
launches the script with the best config, through the same launcher options."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from shardspeed.autotuning.results import OPTIMAL_CONFIG
from shardspeed.autotuning.runner import with_config_arg
from shardspeed.autotuning.space import Point
from shardspeed.autotuning.tune import TuneError, TuneRequest, describe, script_args_for, tune
from shardspeed.config.autotuning import AutotuningConfig

__all__ = ["autotune", "config_path_of", "strip_autotuning_flags"]

MODES = ("tune", "run")
OWN_FLAGS = ("--autotuning", "--device_memory_gb", "--host_memory_gb")


def config_path_of(script_args: list[str]) -> str | None:
    """The value of the script's ``--deepspeed_config`` (either spelling), or None."""
    for i, word in enumerate(script_args):
        if word == "--deepspeed_config" and i + 1 < len(script_args):
            return script_args[i + 1]
        if word.startswith("--deepspeed_config="):
            return word.split("=", 1)[1]
    return None


def strip_autotuning_flags(launcher_words: list[str]) -> list[str]:
    """The launcher words without the autotuner's own flags (``--flag V`` and ``--flag=V``), for the final launch."""
    out: list[str] = []
    skip = False
    for word in launcher_words:
        if skip:
            skip = False
        elif word in OWN_FLAGS:
            skip = True
        elif not word.startswith(tuple(f"{f}=" for f in OWN_FLAGS)):
            out.append(word)
    return out


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(143)


def autotune(options: argparse.Namespace, launcher_words: list[str], launch: Callable[[list[str]], int]) -> int:
    """Entry from the launcher (cli.py) once the command line parsed; returns the exit status."""
    mode = options.autotuning
    if mode not in MODES:
        print(f"shardspeed: error: --autotuning {mode!r}: expected tune or run", file=sys.stderr)
        return 2
    config = config_path_of(options.script_args)
    if config is None:
        print(
            "shardspeed: error: --autotuning needs the script's --deepspeed_config FILE (the config whose "
            "autotuning section and tuning space it reads)",
            file=sys.stderr,
        )
        return 2
    nprocs = options.num_procs or options.num_gpus or 1
    launcher_args = ["--module"] if options.module else []
    request = TuneRequest(
        config,
        options.script,
        list(options.script_args),
        nprocs,
        device_memory_gb=options.device_memory_gb,
        host_memory_gb=options.host_memory_gb,
        launcher_args=launcher_args,
    )
    try:
        section = AutotuningConfig.model_validate(json.loads(Path(config).read_text()).get("autotuning") or {})
    except (OSError, ValueError) as error:
        print(f"shardspeed: error: --autotuning: {config}: {error}", file=sys.stderr)
        return 2
    optimal = Path(section.results_dir) / OPTIMAL_CONFIG
    best_point: Point | None = None
    if mode == "tune" or section.overwrite or not optimal.exists():
        # SIGTERM must unwind (the runner's finally stops the trial in flight: it runs in a session of its own)
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            report = tune(request)
        except TuneError as error:
            print(f"shardspeed: error: --autotuning: {error}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGTERM, previous)
        print(describe(report), file=sys.stderr)
        if report.best is None:
            return 1
        best_point = Point(**report.best.point)
    if mode == "tune":
        return 0
    args = list(options.script_args)
    if best_point is not None:
        args = script_args_for(args, json.loads(optimal.read_text()), best_point, section.arg_mappings)
    argv = [*strip_autotuning_flags(launcher_words), options.script, *with_config_arg(args, optimal)]
    print(f"[autotuning] training with {optimal}", file=sys.stderr, flush=True)
    return launch(argv)
