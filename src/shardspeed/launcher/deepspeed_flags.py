"""DeepSpeed runner flags beyond the core ones: what each does here, or why it is refused.

Implemented (per rank, through ``rank_exec.py``): ``--module``, ``--no_python``, ``--no_local_rank``,
``--bind_cores_to_rank``, ``--bind_core_list``, ``--enable_each_rank_log DIR``. Implemented in the launcher:
``--save_pid`` (``cli.py``), ``--launcher_args``, ``--ssh_port``, ``--venv_script`` (multi-node commands,
``multinode.py``), ``--no_ssh`` (= ``--node_rank`` mode; it requires ``--node_rank`` as in DeepSpeed),
``--no_ssh_check`` (accepted: we run no ssh pre-check; ``BatchMode=yes`` makes an unreachable host fail at once),
``--force_multi``, ``--autotuning`` (autotuning/command.py). Refused before anything starts, each with its
reason (``REFUSED``): elastic training, and the SLURM-only ``--comment`` / ``--account``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.rank_exec import SEPARATOR

RANK_EXEC_SCRIPT = str(Path(__file__).resolve().with_name("rank_exec.py"))

# DeepSpeed launchers shardspeed does not drive; the reason names what to do instead.
OTHER_LAUNCHERS = ("openmpi", "mvapich", "slurm", "mpich", "impi", "jsrun")

REFUSED: dict[str, str] = {
    "elastic_training": "elastic training is not implemented yet: the world size is fixed for the whole job "
    "(a failed rank can restart the worker group at the same size: --max_restarts N)",
    "min_elastic_nodes": "elastic training is not implemented yet, so --min_elastic_nodes has no meaning",
    "max_elastic_nodes": "elastic training is not implemented yet, so --max_elastic_nodes has no meaning",
    "comment": "--comment is passed to srun by DeepSpeed's SLURM launcher, which shardspeed does not have; under "
    "SLURM start the script with srun directly (init_distributed reads SLURM's environment)",
    "account": "--account is passed to srun by DeepSpeed's SLURM launcher, which shardspeed does not have; under "
    "SLURM start the script with srun directly (init_distributed reads SLURM's environment)",
}


def check_refused(options: argparse.Namespace) -> None:
    """Raise LauncherError for the first refused flag that was given (flags: True; values: not None/empty)."""
    for name, reason in REFUSED.items():
        value = getattr(options, name, None)
        if value not in (None, False, ""):
            raise LauncherError(f"--{name}: {reason}")
    launcher = getattr(options, "launcher", "auto")
    if launcher.lower() in OTHER_LAUNCHERS:
        raise LauncherError(
            f"--launcher {launcher}: not implemented (shardspeed starts nodes over ssh or pdsh); with "
            f"{launcher} start the script with its own launcher (srun / mpirun) directly — init_distributed reads "
            "SLURM's and Open MPI's environment"
        )
    if options.no_ssh and options.node_rank is None:
        raise LauncherError("--no_ssh starts this node only and needs --node_rank (this node's index)")
    if options.module and options.no_python:
        raise LauncherError("--module and --no_python cannot be used together (a module needs python)")
    if options.bind_core_list is not None and not options.bind_cores_to_rank:
        raise LauncherError("--bind_core_list needs --bind_cores_to_rank (it lists the cores to divide among ranks)")


@dataclass(frozen=True)
class RankOptions:
    """How each rank's script is started (the options of ``rank_exec.py``)."""

    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    each_rank_log: str | None = None
    log_prefix: str = ""

    def words(self) -> list[str]:
        """``rank_exec.py``'s option words."""
        words = [
            f"--{name}"
            for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank")
            if getattr(self, name)
        ]
        if self.bind_core_list is not None:
            words += ["--bind_core_list", self.bind_core_list]
        if self.each_rank_log is not None:
            words += ["--each_rank_log", self.each_rank_log, "--log_prefix", self.log_prefix]
        return words


def rank_options(options: argparse.Namespace, now: float | None = None) -> RankOptions:
    """RankOptions from the parsed launcher options; one log-file prefix (a timestamp, as DeepSpeed's) per job."""
    log_dir = options.enable_each_rank_log
    if log_dir == "None":  # DeepSpeed's default spelled out on a command line
        log_dir = None
    if options.bind_core_list is not None:
        from shardspeed.launcher.rank_exec import RankExecError, parse_core_list

        try:
            parse_core_list(options.bind_core_list)
        except RankExecError as error:
            raise LauncherError(str(error)) from None
    return RankOptions(
        module=options.module,
        no_python=options.no_python,
        no_local_rank=options.no_local_rank,
        bind_cores_to_rank=options.bind_cores_to_rank,
        bind_core_list=options.bind_core_list,
        each_rank_log=str(Path(log_dir).resolve()) if log_dir is not None else None,
        log_prefix=time.strftime("%Y%m%d%H%M%S", time.localtime(now)) if log_dir is not None else "",
    )


def rank_program(rank: RankOptions, script: str, script_args: list[str]) -> tuple[str, list[str]]:
    """What torchrun runs per rank: ``rank_exec.py`` and its arguments, ending with the user's command."""
    return RANK_EXEC_SCRIPT, [*rank.words(), SEPARATOR, script, *script_args]
