"""How the engine's optimizer and offloading are built from the typed config (construction only; the loop is in
``training/``). Each function takes what it needs explicitly; the engine calls them once, in order."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardspeed.comm import Collectives, CommsLog
from shardspeed.comm.algorithms import CollectiveChoice, default_bucket_numel
from shardspeed.comm.calibrate import resolve_choice
from shardspeed.comm.order_check import check_flags_agree, requested
from shardspeed.comm.simulated_link import SimulatedLink
from shardspeed.compression.engine_wiring import bind_compressed_optimizer, check_compressed_setup
from shardspeed.config import ShardSpeedConfig, ZeroConfig
from shardspeed.faults.board import FailureBoard
from shardspeed.optim import build_optimizer, is_elementwise
from shardspeed.optim.build import prefer_client_optimizer
from shardspeed.optim.lamb import Lamb
from shardspeed.params.spec import ParamSpecs
from shardspeed.precision.norm_weights import counted_weights
from shardspeed.topology import AxisGroup, Topology
from shardspeed.zero.compressed_adam import zero_compressed_optimizer
from shardspeed.zero.sharded_lamb import ShardedLamb, lamb_norm_axes, sum_over

__all__ = [
    "bucket_defaults",
    "build_engine_optimizer",
    "check_param_offload",
    "engine_collectives",
    "masters_go_to_optimizer",
    "offload_params",
    "param_offload_opener",
]


def engine_collectives(
    config: ShardSpeedConfig,
    topology: Topology,
    board: FailureBoard | None = None,
    device: torch.device | None = None,
) -> Collectives:
    """The engine's ``Collectives``: comms log per ``comms_logger``; collective-order verification when
    ``fault_tolerance.verify_collective_order`` or ``SHARDSPEED_VERIFY_COLLECTIVES=1`` asks for it. Whether to
    verify is agreed first over every axis the engine communicates on (one small exchange each, on or off): a rank
    that verified alone would pair its checks with its peers' real collectives."""
    log = CommsLog(config.comms_logger.enabled, tuple(config.comms_logger.prof_ops))
    want = requested(config.fault_tolerance.verify_collective_order)
    unverified = Collectives(log, board)
    for axis in (topology.pipe, topology.data, topology.tensor):
        check_flags_agree(unverified.all_gather_object(want, axis), axis.ranks)
    sim = config.communication.simulated_link  # a SIMULATION, off by default ([Note: simulated link])
    link = SimulatedLink(sim.bandwidth_gbps, sim.latency_us) if sim is not None else None
    collectives = Collectives(log, board, verify_order=want, link=link)
    # [Note: agreed calibration] in comm/calibrate.py: measured on the data axis (whose buckets matter) and used
    # there only; agreed over the world, since every data group's ranks also meet in tensor / pipe collectives
    comm = config.communication
    collectives.algorithms = resolve_choice(
        comm.collectives,
        comm.calibration_cache,
        collectives,
        topology.data,
        config.grad_comm_dtype,
        device=device,
        world=topology.world,
    )
    return collectives


def bucket_defaults(zero: ZeroConfig, choice: CollectiveChoice, log: bool = False) -> ZeroConfig:
    """``zero`` with ``reduce_bucket_size`` / ``allgather_bucket_size`` at the knee of ``choice``'s measured
    bandwidth curve where the config did not set them (``model_fields_set``; ``"auto"`` counts as unset); set
    values always win, and without a curve (native, NCCL) or a spare core per rank ([Note: overlap needs a spare
    core] in comm/algorithms.py) DeepSpeed's defaults stay. Logged when ``log``."""
    knee = default_bucket_numel(choice)
    unset = {"reduce_bucket_size", "allgather_bucket_size"} - zero.model_fields_set
    if log and unset and choice.cores_per_rank is not None:
        logging.getLogger("shardspeed").info(
            "%s: %s (%g cores per rank)",
            " and ".join(sorted(unset)),
            f"{knee:,} elements, the knee of the {choice.source} bandwidth curve"
            if knee
            else "DeepSpeed's default (no spare core to overlap communication with compute)",
            choice.cores_per_rank,
        )
    if knee is None or not unset:
        return zero
    return zero.model_copy(update=dict.fromkeys(unset, knee))


def check_param_offload(config: ShardSpeedConfig, device: torch.device) -> None:
    """``offload_param`` combinations that cannot work, refused before the stage attaches hooks to the module."""
    from shardspeed.zero.stage3.param_offload import check_param_offload as check

    zero = config.zero_optimization
    check(
        zero.offload_param.device if zero.offload_param is not None else "none",
        zero.stage,
        config.compute_dtype != torch.float32,
        device.type != "cpu",
        zero.offload_optimizer.device if zero.offload_optimizer is not None else "none",
    )


def param_offload_opener(
    config: ShardSpeedConfig, axis: AxisGroup, collectives: Collectives, device: torch.device
) -> Callable[[Sequence[Any]], Any] | None:
    """``offload_param`` (stage 3): opens the store parameter shards move to between uses (host memory or a swap
    file; ``max_in_cpu`` of them stay in host memory; ``buffer_count`` × ``buffer_size`` bound the host buffers
    shards are read from NVMe into) for the units described (``UnitShape``s or ``ParamUnit``s). None when nothing
    moves. Stage 3 calls it before materializing ([Note: offload during construction] in early_offload.py)."""
    from shardspeed.zero.stage3.param_offload import build_param_offloader, needs_offloader

    zero = config.zero_optimization
    offload = zero.offload_param
    if zero.stage != 3 or offload is None or not needs_offloader(offload.device, device.type != "cpu"):
        return None

    def open_store(units: Sequence[Any]) -> Any:
        return build_param_offloader(
            units,
            offload.device,
            nvme_path=offload.nvme_path,
            pin_memory=offload.pin_memory,
            settings=config.aio.settings(),
            rank=axis.rank,
            agree=lambda obj: collectives.all_gather_object(obj, axis),
            buffer_count=offload.buffer_count,
            buffer_size=offload.buffer_size,
            max_in_cpu=offload.max_in_cpu,
            prefetch_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
        )

    return open_store


def offload_params(
    config: ShardSpeedConfig, states: Any, axis: AxisGroup, collectives: Collectives, device: torch.device
) -> None:
    """``offload_param`` after the stage is built: the store the stage opened during construction (or one opened
    now) takes over every non-persistent unit (stand-ins for fp32 stepped tensors: ``Stage3States.offload_params``)."""
    open_store = param_offload_opener(config, axis, collectives, device)
    if open_store is None:
        return
    offloader = getattr(states, "param_offloader", None)
    if offloader is None:
        offloader = open_store([u for u in states.units if not u.persistent])
    states.offload_params(offloader)


def build_engine_optimizer(
    config: ShardSpeedConfig,
    states: Any,
    user_optimizer: Any,
    groups: list[dict[str, Any]],
    topology: Topology,
    collectives: Collectives,
    device: torch.device,
    specs: ParamSpecs | None = None,
) -> tuple[Any, bool]:
    """The optimizer over the tensors this stage steps (masters, shards), keeping the user's groups, wrapped for
    ``offload_optimizer`` when configured. Returns it and whether it keeps host copies of the gradients (then it,
    not the stage, scales and forgets them). ``specs``: which parameters are tensor-parallel slices (Lamb)."""
    axis = topology.data
    cfg = config.optimizer
    cfg = cfg if cfg is None or prefer_client_optimizer(cfg.type, user_optimizer) else None
    masters_access = _hand_masters_to_optimizer(config, states, device)
    stepped = states.optimizer_groups(groups)
    if isinstance(user_optimizer, torch.optim.Optimizer):
        swapped = any(a["params"] is not b["params"] for a, b in zip(groups, stepped))
        if swapped and user_optimizer.state:
            raise ValueError("pass a fresh optimizer: it already has state for parameters shardspeed re-homes")
        for group, new in zip(user_optimizer.param_groups, stepped):
            group["params"] = new["params"]
        optimizer = user_optimizer
    else:
        optimizer = build_optimizer(cfg.type if cfg else None, cfg.params if cfg else None, stepped, user_optimizer)
    stage = config.zero_optimization.stage
    check_compressed_setup(config, optimizer, topology)  # first: its message names the real obstacle
    optimizer = zero_compressed_optimizer(optimizer, states, stage, axis, collectives, device)  # 1-bit Adam, ZeRO-1/2
    sliced = specs is not None and topology.tensor.size > 1 and specs.any_partitioned
    if (stage > 0 or sliced) and type(optimizer) is Lamb:
        # Lamb's trust ratio needs whole-parameter norms: sum them across shards and tensor-parallel slices (one
        # small all-reduce; zero/sharded_lamb.py).
        axes = lamb_norm_axes(topology, stage > 0) if sliced else [axis]
        optimizer = ShardedLamb.replacing(
            optimizer,
            states.tensor_segments(),
            num_params=states.num_params,
            all_reduce_sum=lambda t: sum_over(collectives, axes, t),
            weights=counted_weights(specs, states.param_names) if sliced and specs is not None else None,
        )
    elif stage > 0 and not is_elementwise(optimizer) and not config.zero_allow_untested_optimizer:
        raise ValueError(
            f"ZeRO stage {stage} steps flat shards, which is only correct for element-wise optimizers; "
            f"{type(optimizer).__name__} is not known to be element-wise. Set "
            '"zero_allow_untested_optimizer": true to run it anyway.'
        )
    bind_compressed_optimizer(config, states, optimizer, topology, collectives, device)  # 1-bit optimizers
    return _offload(config, states, optimizer, masters_access, axis, collectives)


def masters_go_to_optimizer(config: ShardSpeedConfig, device: torch.device, has_optimizer: bool) -> bool:
    """Whether the fp32 masters (mixed precision) will live only in a streamed offload optimizer's store
    (``_hand_masters_to_optimizer`` hands them over, at any stage), so stage 3 need not build them at construction."""
    from shardspeed.zero.stage3.param_offload import needs_offloader

    offload = config.zero_optimization.offload_optimizer
    streamed = offload is not None and needs_offloader(offload.device, device.type != "cpu")
    return has_optimizer and streamed


def _hand_masters_to_optimizer(config: ShardSpeedConfig, states: Any, device: torch.device) -> Any:
    """Mixed precision with a streamed offload optimizer: the fp32 masters live only in its store (host memory
    or NVMe), not here too. Returns the access to the stand-ins' low-precision values, or None."""
    hand_over = getattr(states, "hand_masters_to_optimizer", None)
    if hand_over is None or not masters_go_to_optimizer(config, device, True):
        return None
    return hand_over()


def _offload(
    config: ShardSpeedConfig, states: Any, optimizer: Any, masters: Any, axis: AxisGroup, collectives: Collectives
) -> tuple[Any, bool]:
    """``offload_optimizer``: the step and its states move to the host (cpu) or a swap file (nvme). ``masters``:
    the access to stand-ins for masters the stage handed over (``_hand_masters_to_optimizer``), or None."""
    zero = config.zero_optimization
    offload = zero.offload_optimizer
    if offload is None or offload.device == "none":
        return optimizer, False
    from shardspeed.offload.wrap import offload_optimizer

    streamed = offload_optimizer(
        optimizer,
        offload,
        settings=config.aio.settings(),
        chunk_numel=zero.sub_group_size,
        rank=axis.rank,
        agree=lambda obj: collectives.all_gather_object(obj, axis),
        # stand-in tensors: ZeRO-3 fp32 offload_param, or mixed precision whose masters the optimizer holds
        access=masters if masters is not None else getattr(states, "stepped_access", None),
        values_in_store=masters is not None,
        offload_grads=_grads_on_nvme(offload, states),
    )
    if hasattr(states, "master_store") and hasattr(streamed, "reseed"):
        states.master_store = streamed  # it holds the fp32 values: GatheredParameters edits must reach it
    host_grads = getattr(streamed, "host_grads", None)
    if host_grads is not None:  # each bucket's final gradient starts its copy to the host at once (not with grad_swap)
        states.set_final_grads_hook(streamed.stage_grads)
    grad_swap = getattr(streamed, "grad_swap", None)
    if grad_swap is not None:  # ZeRO-3: each unit's reduced gradient is written behind to the swap file
        states.offload_grads(grad_swap)
    return streamed, getattr(streamed, "scales_grads", False)


def _grads_on_nvme(offload: Any, states: Any) -> bool:
    """ZeRO-Infinity's gradients on NVMe (zero/stage3/grad_offload.py): stage 3, the nvme device, every chunk
    offloaded, and ``offload_gradients`` not switched off."""
    return (
        hasattr(states, "offload_grads")
        and offload.device == "nvme"
        and offload.ratio == 1.0
        and offload.offload_gradients
    )


def log_engine_summary(
    logger: logging.Logger, config: ShardSpeedConfig, topology: Topology, trainable_numel: int, predicted: Any
) -> None:
    """Rank 0's two lines at construction: the layout of the run (the mesh: pipe × data × tensor) and the predicted
    model-state bytes per rank."""
    shape = topology.shape
    logger.info(
        "stage %d, %s, world %d (mesh pipe %d × data %d × tensor %d), %d trainable parameters, "
        "micro batch %d × GAS %d × data %d = %d",
        config.zero_optimization.stage,
        config.compute_dtype,
        shape.world_size,
        shape.pipe,
        shape.data,
        shape.tensor,
        trainable_numel,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        topology.dp_world_size,
        config.train_batch_size,
    )
    logger.info(
        "model states per rank (predicted): params %.1f MB + grads %.1f MB + optimizer %.1f MB = %.1f MB",
        predicted.params / 2**20,
        predicted.grads / 2**20,
        predicted.optimizer / 2**20,
        predicted.total() / 2**20,
    )
