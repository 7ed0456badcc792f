"""From parsed launcher options to the exact commands to run (pure: no processes are started here).

Modes, decided in this order:

- ``--node_rank R`` (manual multi-node, DeepSpeed's ``--no_ssh`` style): run only this node's torchrun
  locally; the user starts the same command on every node with its own R.
- ``--rdzv_backend c10d`` without a hostfile (torchrun's style): likewise this node only, the same command on
  every node with ``--num_nodes N``; torchrun numbers the nodes in the order they join.
- one active host (no hostfile, or a hostfile / filter leaving one host) and no ``--force_multi``: one local
  torchrun with ``--nnodes 1`` — like DeepSpeed, a single host is assumed to be this machine.
- several hosts: one torchrun per host over ssh/pdsh (see ``multinode.py``).

Per rank, torchrun runs ``rank_exec.py`` (``deepspeed_flags.rank_program``), which execs the script as DeepSpeed's
launcher would: ``python -u SCRIPT --local_rank=N ARGS`` by default. DeepSpeed's other runner flags are checked
first (``deepspeed_flags.check_refused``): refused ones stop the launch before anything starts.

Processes per node: the hostfile's slots (capped by ``--num_gpus``/``--num_procs``); without a hostfile,
``--num_procs N`` (N processes, no device check), ``--num_gpus N`` (≤ CUDA devices when there are any), or by
default one per CUDA device — and one process, with a note, on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shardspeed.launcher.deepspeed_flags import RankOptions, check_refused, rank_options, rank_program
from shardspeed.launcher.errors import LauncherError, MissingScriptError
from shardspeed.launcher.failure_report import FAILURE_DIR_ENV
from shardspeed.launcher.hostfile import read_hostfile, unbracketed
from shardspeed.launcher.multinode import RemoteShell, choose_launcher, node_commands
from shardspeed.launcher.processes import LaunchCommand
from shardspeed.launcher.resources import ResourcePool, pool_from_slot_counts, select_resources
from shardspeed.launcher.torchrun import DEFAULT_RDZV_ID, RDZV_BACKENDS, Rendezvous, torchrun_args, torchrun_command

DEFAULT_HOSTFILE = "/job/hostfile"
LOCAL_HOST = "localhost"
LOCAL_MASTER_ADDR = "127.0.0.1"


@dataclass(kw_only=True)
class LaunchPlan:
    """What ``shardspeed`` will run, plus notes worth telling the user (printed to stderr)."""

    commands: list[LaunchCommand]
    resources: ResourcePool
    notes: list[str] = field(default_factory=list)


def cuda_device_count() -> int:
    """Number of visible CUDA devices. Imports torch, so it is only called when the answer matters."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _procs_per_node(options: argparse.Namespace) -> tuple[int | None, str]:
    """The ``--num_gpus``/``--num_procs`` value (they mean the same) and the flag that gave it."""
    if options.num_gpus is not None and options.num_procs is not None:
        raise LauncherError("--num_gpus and --num_procs mean the same (processes per node); pass only one")
    if options.num_procs is not None:
        return options.num_procs, "--num_procs"
    return options.num_gpus, "--num_gpus"


def _local_pool(options: argparse.Namespace, notes: list[str], device_count: Callable[[], int]) -> ResourcePool:
    """The resource pool of this machine alone, when there is no hostfile."""
    procs, flag = _procs_per_node(options)
    if procs is not None and procs < 1:
        raise LauncherError(f"{flag} {procs}: must be at least 1")
    if flag == "--num_procs" and procs is not None:
        return {LOCAL_HOST: list(range(procs))}
    devices = device_count()
    if devices == 0:
        if procs is None:
            notes.append("no CUDA devices found: starting 1 process (use --num_procs N for N CPU processes)")
        return {LOCAL_HOST: list(range(procs or 1))}
    return {LOCAL_HOST: list(range(devices))}


def _resolve_hostfile(options: argparse.Namespace, default_hostfile: str) -> str | None:
    if options.hostfile is not None:
        return options.hostfile
    return default_hostfile if os.path.isfile(default_hostfile) else None


def _check_numbers(options: argparse.Namespace) -> None:
    if not 1 <= options.master_port <= 65535:
        raise LauncherError(f"--master_port {options.master_port}: must be a TCP port in 1..65535")
    if options.node_rank is not None and options.node_rank < 0:
        raise LauncherError(f"--node_rank {options.node_rank}: must be >= 0")
    if options.num_nodes is not None and options.num_nodes < 1:
        raise LauncherError(f"--num_nodes {options.num_nodes}: must be at least 1")
    if options.max_restarts < 0:
        raise LauncherError(f"--max_restarts {options.max_restarts}: must be >= 0")


def _rendezvous(options: argparse.Namespace, master_addr: str) -> Rendezvous:
    """The rendezvous every node's torchrun uses (``torchrun.Rendezvous``), checked before anything starts."""
    backend = options.rdzv_backend
    if backend not in RDZV_BACKENDS:
        raise LauncherError(f"--rdzv_backend {backend!r}: expected one of {', '.join(RDZV_BACKENDS)}")
    if backend == "static":
        for flag in ("rdzv_endpoint", "rdzv_id"):
            if getattr(options, flag) is not None:
                raise LauncherError(f"--{flag} needs --rdzv_backend c10d (the static rendezvous uses --master_port)")
        return Rendezvous(master_addr=master_addr, master_port=options.master_port)
    endpoint = options.rdzv_endpoint
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise LauncherError(f"--rdzv_endpoint {endpoint!r}: expected HOST:PORT with a TCP port in 1..65535")
    run_id = options.rdzv_id if options.rdzv_id is not None else DEFAULT_RDZV_ID
    if not run_id or any(character.isspace() for character in run_id):
        raise LauncherError(f"--rdzv_id {run_id!r}: must be a non-empty word (no spaces)")
    return Rendezvous(
        backend="c10d", master_addr=master_addr, master_port=options.master_port, endpoint=endpoint, run_id=run_id
    )


def _restart_notes(options: argparse.Namespace, nnodes: int, notes: list[str]) -> None:
    if options.max_restarts > 0 and nnodes > 1 and options.rdzv_backend == "static":
        notes.append(
            f"--max_restarts {options.max_restarts} with the static rendezvous restarts only the failing node's "
            "ranks (the others wait in a collective until it times out); use --rdzv_backend c10d to restart "
            "every node together"
        )


def _visible_devices_override(
    slots: list[int], filtered: bool, environ: Mapping[str, str], notes: list[str]
) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a local launch: set only when --include/--exclude chose devices."""
    if not filtered:
        return {}
    value = ",".join(str(slot) for slot in slots)
    previous = environ.get("CUDA_VISIBLE_DEVICES")
    if previous is not None and previous != value:
        notes.append(f"--include/--exclude override CUDA_VISIBLE_DEVICES={previous!r} with {value!r}")
    return {"CUDA_VISIBLE_DEVICES": value}


@dataclass(frozen=True)
class _LocalPlacement:
    """Where the one torchrun started on this machine sits in the job."""

    nnodes: int
    node_rank: int
    host: str
    master_addr: str


def _local_placement(options: argparse.Namespace, active: ResourcePool, from_hostfile: bool) -> _LocalPlacement:
    hosts = list(active)
    if options.node_rank is None and not (options.rdzv_backend == "c10d" and not from_hostfile):
        return _LocalPlacement(1, 0, hosts[0], options.master_addr or LOCAL_MASTER_ADDR)  # the whole job is here
    if options.node_rank is None:  # c10d, each node started by hand: torchrun assigns this node's rank
        return _LocalPlacement(options.num_nodes or 1, 0, hosts[0], options.master_addr or LOCAL_MASTER_ADDR)
    node_rank = options.node_rank
    if from_hostfile:  # this machine is host number node_rank of the hostfile selection
        if node_rank >= len(hosts):
            raise LauncherError(f"--node_rank {node_rank}: the hostfile selection has {len(hosts)} node(s)")
        return _LocalPlacement(len(hosts), node_rank, hosts[node_rank], options.master_addr or unbracketed(hosts[0]))
    nnodes = options.num_nodes or 1
    if node_rank >= nnodes:
        raise LauncherError(f"--node_rank {node_rank}: must be below --num_nodes {nnodes}")
    return _LocalPlacement(nnodes, node_rank, hosts[0], options.master_addr or LOCAL_MASTER_ADDR)


def _local_command(
    options: argparse.Namespace,
    rank: RankOptions,
    placement: _LocalPlacement,
    slots: list[int],
    filtered: bool,
    environ: Mapping[str, str],
    notes: list[str],
    failure_dir: str | None,
) -> LaunchCommand:
    # --module / --no_python name a module or an executable on PATH, not necessarily a file here.
    if not (rank.module or rank.no_python) and not os.path.exists(options.script):
        raise MissingScriptError(f"training script {options.script!r} not found (cwd: {os.getcwd()})")
    for flag in ("launcher_args", "ssh_port", "venv_script"):
        if getattr(options, flag) not in (None, ""):
            notes.append(f"--{flag} applies to remote nodes started over ssh/pdsh; ignored for this local launch")
    program, program_args = rank_program(rank, options.script, options.script_args)
    _restart_notes(options, placement.nnodes, notes)
    arguments = torchrun_args(
        nnodes=placement.nnodes,
        node_rank=placement.node_rank,
        nproc_per_node=len(slots),
        rendezvous=_rendezvous(options, placement.master_addr),
        script=program,
        script_args=program_args,
        max_restarts=options.max_restarts,
    )
    env_overrides = _visible_devices_override(slots, filtered, environ, notes)
    if failure_dir is not None:
        env_overrides[FAILURE_DIR_ENV] = failure_dir
    c10d_ranked = options.rdzv_backend == "c10d" and placement.nnodes > 1  # torchrun numbers the nodes
    return LaunchCommand(
        name=f"this node ({placement.host})" if c10d_ranked else f"node {placement.node_rank} ({placement.host})",
        argv=torchrun_command(arguments),
        env_overrides=env_overrides,
    )


def plan_launch(
    options: argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
    device_count: Callable[[], int] = cuda_device_count,
    default_hostfile: str = DEFAULT_HOSTFILE,
    which: Callable[[str], str | None] = shutil.which,
    failure_dir: str | None = None,
) -> LaunchPlan:
    """Turn parsed launcher options (see ``cli.parse_launch_args``) into a :class:`LaunchPlan`.

    ``environ``, ``device_count``, ``default_hostfile`` and ``which`` are the outside world (environment,
    CUDA, the filesystem, PATH), injectable so that planning is testable on any machine. ``failure_dir``: this
    launch's ``SHARDSPEED_FAILURE_DIR`` (``failure_report.py``), put into every node's environment.
    """
    environ = os.environ if environ is None else environ
    check_refused(options)
    _check_numbers(options)
    rank = rank_options(options)
    notes: list[str] = []
    procs, _ = _procs_per_node(options)
    hostfile = _resolve_hostfile(options, default_hostfile)
    if hostfile is not None:
        pool = pool_from_slot_counts(read_hostfile(hostfile))
        num_nodes = options.num_nodes
    else:
        if options.num_nodes not in (None, 1) and options.node_rank is None and options.rdzv_backend == "static":
            raise LauncherError(
                f"--num_nodes {options.num_nodes} needs a --hostfile listing the nodes (or --node_rank, or "
                "--rdzv_backend c10d, to start each node by hand)"
            )
        pool = _local_pool(options, notes, device_count)
        num_nodes = None  # without a hostfile, --num_nodes counts hand-started nodes, not pool hosts
    active = select_resources(
        pool, include=options.include, exclude=options.exclude, num_nodes=num_nodes, procs_per_node=procs
    )
    filtered = options.include is not None or options.exclude is not None

    hand_started = options.rdzv_backend == "c10d" and hostfile is None  # each node runs its own shardspeed
    if options.node_rank is not None or hand_started or (len(active) == 1 and not options.force_multi):
        placement = _local_placement(options, active, from_hostfile=hostfile is not None)
        command = _local_command(
            options, rank, placement, active[placement.host], filtered, environ, notes, failure_dir
        )
        return LaunchPlan(commands=[command], resources=active, notes=notes)

    program, program_args = rank_program(rank, options.script, options.script_args)
    _restart_notes(options, len(active), notes)
    commands = node_commands(
        active,
        launcher=choose_launcher(options.launcher, which),
        rendezvous=_rendezvous(options, options.master_addr or unbracketed(next(iter(active)))),
        max_restarts=options.max_restarts,
        script=program,
        script_args=program_args,
        set_visible_devices=filtered,
        environ=environ if failure_dir is None else {**environ, FAILURE_DIR_ENV: failure_dir},
        remote=RemoteShell.from_options(options),
    )
    return LaunchPlan(commands=commands, resources=active, notes=notes)
