"""``shardspeed.initialize``: DeepSpeed's entry point, same arguments and return value."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardspeed.comm import Collectives
from shardspeed.config import load_config
from shardspeed.distributed import init_distributed
from shardspeed.engine import ShardSpeedEngine
from shardspeed.faults.guard import EngineGuard
from shardspeed.faults.process import failure_board
from shardspeed.faults.resume import resume_latest
from shardspeed.faults.startup import configured_timeout, early_fault_config
from shardspeed.mesh import resolve_mesh
from shardspeed.pipe.engine import PipelineEngine, is_pipeline_module
from shardspeed.tensor_parallel.autotp_initialize import slice_for_autotp
from shardspeed.topology import Topology


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[ShardSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """Build the engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like DeepSpeed; for a
    ``shardspeed.pipe.PipelineModule`` the engine is a ``PipelineEngine`` (``train_batch`` / ``eval_batch``).

    Parameters in DeepSpeed's order. ``config`` is a dict or a path to a DeepSpeed JSON file; as in DeepSpeed it
    may also come from ``args.deepspeed_config`` (or the deprecated ``args.deepscale_config``) or the older
    ``config_params``. ``distributed_port`` is the rendezvous port when the launcher sets none (SLURM, MPI).
    """
    if model is None:
        raise ValueError("initialize() needs model=…")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...): sequence-parallel device meshes are not implemented yet")
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None:
        config = (
            getattr(args, "deepspeed_config", None)
            or getattr(args, "deepscale_config", None)
            or getattr(args, "shardspeed_config", None)
        )
    if config is None:
        raise ValueError("initialize() needs config=… (a dict or a DeepSpeed JSON path), or args.deepspeed_config")
    faults = early_fault_config(config)  # the group's timeout is needed before the config can be parsed
    init_distributed(
        distributed_port=distributed_port, dist_init_required=dist_init_required, timeout=configured_timeout(faults)
    )
    # The mesh before the batch arithmetic: DP = world / (TP × PP) ([Note: where the mesh comes from] in mesh.py).
    # A PipelineModule built its topology already: it is the mpu, its stage count the pipe axis.
    pipeline = is_pipeline_module(model)
    if pipeline and mpu is None:
        mpu = model.topology
    stages = model.num_stages if pipeline else None  # type: ignore[union-attr]
    shape = resolve_mesh(config, dist.get_world_size() if dist.is_initialized() else 1, mpu, pipeline_stages=stages)
    topology = Topology.from_mpu(mpu) if mpu is not None else Topology.build(shape)
    # Construction is guarded too: a rank that fails building its engine must not leave the others waiting in
    # the construction's collectives ([Note: failure propagation] in faults/board.py).
    board = failure_board(faults)
    with EngineGuard(board, topology.global_rank).call("shardspeed.initialize()"):
        cfg = load_config(config, dp_world_size=topology.dp_world_size)
        # AutoTP (tensor_parallel.autotp_size): the model is sliced on this topology before the engine sees it
        # (its one agreement, whether any rank's model is on the meta device, waits interruptibly on the board)
        model_parameters = slice_for_autotp(
            model, topology, cfg.tensor_parallel, optimizer, model_parameters, Collectives(board=board)
        )
        engine = (PipelineEngine if pipeline else ShardSpeedEngine)(
            model,
            cfg,
            topology,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            training_data=training_data,
            collate_fn=collate_fn,
        )
    from shardspeed import checkpointing

    if "activation_checkpointing" in cfg.model_fields_set:
        # The config names activation checkpointing: set up shardspeed.checkpointing the way a DeepSpeed user
        # would with deepspeed.checkpointing.configure(mpu, deepspeed_config=...), on this engine's topology.
        checkpointing.configure(
            topology=topology, deepspeed_config=cfg.activation_checkpointing, collectives=engine.collectives
        )
    else:  # a model_parallel_manual_seed before initialize learns its tensor rank now (checkpointing/rng.py)
        checkpointing.adopt_topology(topology)
    resume_latest(engine, cfg.fault_tolerance)  # fault_tolerance.auto_resume: continue from checkpoint_dir's latest
    engine.preemption.install()  # fault_tolerance.preemption_signals: stop at the next step boundary
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
