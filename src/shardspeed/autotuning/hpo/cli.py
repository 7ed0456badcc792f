"""``shardspeed hpo --space space.json [hpo options] [launcher options] train.py --deepspeed_config cfg.json [args]``.

Launcher options (``--module``, ``--include``, ``--bind_cores_to_rank``, ...) reach every trial's launch and the
``cmd_best.txt`` command; they are checked by the launcher's own parser. ``--num_procs`` is this command's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from shardspeed.autotuning.hpo.space import SpaceError, load_space
from shardspeed.autotuning.hpo.substitute import split_config_arg

if TYPE_CHECKING:
    import optuna

    from shardspeed.autotuning.hpo.study import HpoJob


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardspeed hpo",
        description="Hyper-parameter search with Optuna: each trial is a short launch of the script with the "
        "trial's values in a copy of its --deepspeed_config and its arguments. Needs the hpo extra (optuna).",
    )
    parser.add_argument("--space", required=True, help="the search-space JSON file (params + study settings)")
    parser.add_argument("--num_procs", type=int, default=1, help="processes per trial (default 1)")
    parser.add_argument("--results_dir", default="hpo_results", help="results and the default study storage")
    parser.add_argument(
        "--storage",
        default=None,
        help="Optuna storage: sqlite:///PATH, postgresql://..., mysql://..., or journal:PATH "
        "(default: journal:RESULTS_DIR/study.journal); several workers on one storage share the study",
    )
    parser.add_argument("--study_name", default="hpo", help="the study's name in the storage (default hpo)")
    parser.add_argument("--n_trials", type=int, default=None, help="override study.n_trials (the study's total)")
    parser.add_argument(
        "--worker",
        type=int,
        default=None,
        help="this worker's index: seeds differ per worker (default: a hash of host and pid, so two workers "
        "started alike draw different points; give it for reproducible draws)",
    )
    parser.add_argument("--lr_range_test", action="store_true", help="run the LR range test first pass")
    parser.add_argument("--no_plots", action="store_true", help="skip Optuna's plots")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (with --deepspeed_config)")
    return parser


HPO_VALUE_FLAGS = ("--space", "--num_procs", "--results_dir", "--storage", "--study_name", "--n_trials", "--worker")
HPO_FLAGS = ("--lr_range_test", "--no_plots", "-h", "--help")


def split_launcher_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this command's words with the script and its arguments, the launcher options before the script)."""
    from shardspeed.launcher.cli import value_flags

    launcher_takes_value = value_flags()
    own: list[str] = []
    launcher: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-", "--"):
        name = argv[i].split("=", 1)[0]
        takes = "=" not in argv[i] and (name in HPO_VALUE_FLAGS or name in launcher_takes_value)
        width = 2 if takes else 1
        (own if name in HPO_VALUE_FLAGS or name in HPO_FLAGS else launcher).extend(argv[i : i + width])
        i += width
    if i < len(argv) and argv[i] == "--":
        i += 1
    return own + argv[i:], launcher


def check_launcher_args(words: list[str]) -> None:
    """The launcher's parser reads them (an unknown option is its usage error); options the trials own refuse."""
    from shardspeed.launcher.cli import parse_launch_args

    options = parse_launch_args([*words, "script.py"])
    if getattr(options, "autotuning", None) or any(w.split("=")[0] in ("--num_gpus", "--master_port") for w in words):
        raise SpaceError("launcher options --autotuning / --num_gpus / --master_port are set per trial by hpo")


def default_worker() -> int:
    """[Note: seeds across runs and workers] without ``--worker``: a hash of host and pid."""
    return zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode()) % 1_000_003


def job_from_args(args: argparse.Namespace, launcher_args: list[str] | None = None) -> HpoJob:
    from shardspeed.autotuning.hpo.study import HpoJob, load_config

    space = load_space(args.space)
    study_updates: dict[str, object] = {}
    if args.n_trials is not None:
        study_updates["n_trials"] = args.n_trials
    if args.lr_range_test:
        study_updates["lr_range_test"] = space.study.lr_range_test.model_copy(update={"enabled": True})
    if study_updates:
        space = type(space).model_validate(
            {**space.model_dump(), "study": {**space.study.model_dump(), **study_updates}}
        )
    config_path, script_args = split_config_arg(args.script_args)
    if config_path is None:
        raise SpaceError("the script's --deepspeed_config is required: it is every trial's base config")
    return HpoJob(
        space=space,
        script=args.script,
        script_args=script_args,
        ds_config=load_config(config_path),
        num_procs=args.num_procs,
        results_dir=Path(args.results_dir),
        storage=args.storage,
        study_name=args.study_name,
        worker=default_worker() if args.worker is None else args.worker,
        launcher_args=list(launcher_args or []),
    )


def _print_trial(trial: optuna.trial.FrozenTrial, finished: int, total: int | None) -> None:
    params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    value = "" if trial.value is None else f" value={trial.value:.6g}"
    why = trial.user_attrs.get("stopped") or trial.user_attrs.get("error") or ""
    print(f"[hpo] trial {trial.number} {trial.state.name}{value} {params} {why}".rstrip(), end="")
    print(f" ({finished}/{total if total is not None else '?'})", flush=True)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises ``SystemExit``, so the runner's ``finally`` stops the running trial's launch (it runs in a
    session of its own: nothing else would). SIGKILL cannot be caught: that trial runs on to its last step."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str]) -> int:
    own, launcher_args = split_launcher_args(list(argv))
    args = build_parser().parse_args(own)
    if importlib.util.find_spec("optuna") is None:
        print("shardspeed hpo: error: needs optuna: pip install 'shardspeed[hpo]'", file=sys.stderr)
        return 2
    from shardspeed.autotuning.hpo.results import write_results
    from shardspeed.autotuning.hpo.study import run_study

    try:
        check_launcher_args(launcher_args)
        job = job_from_args(args, launcher_args)
        total = job.space.study.n_trials
        with sigterm_unwinds():
            study = run_study(job, on_trial=lambda t, n: _print_trial(t, n, total))
    except SpaceError as error:
        print(f"shardspeed hpo: error: {error}", file=sys.stderr)
        return 2
    summary = write_results(study, job, plots=not args.no_plots)
    print((job.results_dir / "summary.txt").read_text(), end="")
    best = summary["best"]
    if best is None:
        print(f"shardspeed hpo: no trial completed; see {job.results_dir / 'trials.csv'}", file=sys.stderr)
        return 1
    print(f"[hpo] best trial {best['number']}: {best['metric']}={best['value']:.6g} {best['params']}")
    print(f"[hpo] train with: {best['command']}")
    return 0
