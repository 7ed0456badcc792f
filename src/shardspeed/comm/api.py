"""DeepSpeed's ``deepspeed.comm`` functions (``import shardspeed.comm as dist``), with DeepSpeed's signatures.

Thin adapters onto ``torch.distributed``: the user's own collectives in a training script (``dist.get_rank()``,
``dist.all_reduce(loss)``, ``dist.barrier()``). The engine never calls these — its traffic goes through
``Collectives`` with explicit mesh axes — so they do not appear in the engine's ``CommsLog``.

Two differences from calling ``torch.distributed`` directly, both from shardspeed's "a lone process is a world of
one" rule (``init_distributed`` creates no process group without a launcher): before a group exists, ``get_rank``
is 0, ``get_world_size`` is 1, and every collective is the identity on one rank (``all_reduce`` leaves the tensor,
``all_gather`` copies it into the single slot, ``barrier`` returns). DeepSpeed raises there instead; a script that
works on a cluster thus also runs unchanged as ``python train.py``.

DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``) are accepted and ignored: shardspeed's comms
logging is configured by the config's ``comms_logger`` section and covers the engine's collectives.
"""

from __future__ import annotations

import gc
import os
import warnings
from datetime import datetime, timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from shardspeed.distributed import default_backend, detect_launch_env
from shardspeed.distributed import init_distributed as _init_distributed

Group = Any  # a torch ProcessGroup or None (the default group)


def _world() -> bool:
    """True when a process group exists (collectives go to torch.distributed); False: a world of one."""
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """``deepspeed.comm.init_distributed``: shardspeed's ``init_distributed`` (returns None, as DeepSpeed's)."""
    _init_distributed(
        dist_backend=dist_backend,
        auto_mpi_discovery=auto_mpi_discovery,
        distributed_port=distributed_port,
        verbose=verbose,
        timeout=timeout,
        init_method=init_method,
        dist_init_required=dist_init_required,
        config=config,
        rank=rank,
        world_size=world_size,
    )


def is_initialized() -> bool:
    return _world()


def is_available() -> bool:
    return True


def get_backend(group: Group = None) -> str:
    return dist.get_backend(group) if _world() else default_backend()


def get_rank(group: Group = None) -> int:
    return dist.get_rank(group) if _world() else 0


def get_world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if _world() else 1


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (torchrun, SLURM, Open MPI)."""
    return detect_launch_env(os.environ).local_rank


def get_global_rank(group: Group = None, group_rank: int = 0) -> int:
    if not _world():
        return group_rank
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_world_group() -> Group:
    return dist.group.WORLD if _world() else None


def new_group(ranks: list[int]) -> Group:
    return dist.new_group(ranks) if _world() else None


def destroy_process_group(group: Group = None) -> None:
    if _world():
        dist.destroy_process_group(group)


def barrier(
    group: Group = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: str = "",
) -> Any:
    if not _world():
        return None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str = "",
) -> Any:
    if not _world():
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: str = "",
) -> Any:
    if not _world():
        return None
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: str = "",
) -> Any:
    if not _world():
        _check_single_slot(tensor_list, "tensor_list")
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug: str = "",
) -> Any:
    if not _world():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: str = "",
) -> Any:
    if not _world():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: str = "",
) -> Any:
    if not _world():
        return None
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: str = "",
) -> Any:
    if not _world():
        output.copy_(tensor)
        return None
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def send(
    tensor: torch.Tensor,
    dst: int,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: str = "",
) -> Any:
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: str = "",
) -> Any:
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(
    tensor: torch.Tensor,
    dst: int,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: str = "",
) -> Any:
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: str = "",
) -> Any:
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: str = "",
) -> Any:
    if not _world():
        if gather_list is not None:
            _check_single_slot(gather_list, "gather_list")
            gather_list[0].copy_(tensor)
        return None
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: str = "",
) -> Any:
    if not _world():
        if scatter_list is not None:
            _check_single_slot(scatter_list, "scatter_list")
            tensor.copy_(scatter_list[0])
        return None
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Group = None, device: Any = None) -> None:
    if _world():
        dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(
    object_list: list[Any],
    obj: Any,
    group: Group = None,
    prof: bool = False,
    log_name: str = "all_gather_object",
    debug: str = "",
) -> None:
    if not _world():
        _check_single_slot(object_list, "object_list")
        object_list[0] = obj
        return
    dist.all_gather_object(object_list, obj, group=group)


def monitored_barrier(
    group: Group = None,
    timeout: timedelta | None = None,
    wait_all_ranks: bool = False,
    prof: bool = False,
    log_name: str = "monitored_barrier",
    debug: str = "",
) -> None:
    if _world():
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def log_summary(show_straggler: bool = False, return_dict: bool = False, *, engine: Any = None) -> dict | None:
    """DeepSpeed's ``deepspeed.comm.log_summary()``: print the comms log's summary on rank 0 (each rank returns
    its own figures with ``return_dict``). The log is the engine's (``engine.comms_log``, per ``comms_logger``):
    pass ``engine=``, or leave it out when exactly one live engine has an enabled log ([Note: finding the comms
    log] in comm/log.py). Unlike DeepSpeed no barrier is needed: nothing is exchanged between ranks.
    ``show_straggler`` (a cross-rank latency comparison) is not supported: it warns and prints the summary."""
    from shardspeed.comm.log import live_logs

    logs = [engine.comms_log] if engine is not None else live_logs()
    if len(logs) > 1:  # a dropped engine's log can linger in a reference cycle until the next collection
        gc.collect()
        logs = live_logs()
    if engine is not None and not logs[0].enabled:
        raise RuntimeError(
            'log_summary: this engine\'s comms log is disabled; set "comms_logger": {"enabled": true} in its config'
        )
    if not logs:
        raise RuntimeError(
            'log_summary: no engine has an enabled comms log; set "comms_logger": {"enabled": true} in the config '
            "and call shardspeed.comm.log_summary() (or print engine.comms_log.summary()) after training"
        )
    if len(logs) > 1:
        raise RuntimeError(
            f"log_summary: {len(logs)} live engines have enabled comms logs; pass engine=... or print "
            "engine.comms_log.summary() for the one you mean"
        )
    log = logs[0]
    if show_straggler:
        warnings.warn(
            "log_summary(show_straggler=True) is not supported by shardspeed; printing the summary only", stacklevel=2
        )
    if get_rank() == 0:
        print(log.summary(), flush=True)
    if not return_dict:
        return None
    meta = {"world_size": get_world_size(), "rank": get_rank(), "timestamp": datetime.now().isoformat()}
    return {"summary": log.rows(), "straggler_analysis": None, "metadata": meta}


def _check_single_slot(slots: list[Any], name: str) -> None:
    if len(slots) != 1:
        raise ValueError(f"{name} has {len(slots)} entries but the world has 1 process (no process group)")


__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
