"""The training engine: construction and DeepSpeed's engine API. It builds the pieces from the typed config once;
the loop itself lives in ``training/`` ([Note: engine layout]).

One training step, traced (see docs/architecture.md):
  engine(x)            → module forward (parameters already in the compute dtype)
  engine.backward(l)   → ``MicroStepDriver``: scale loss by 1/GAS (× loss scale for fp16); gradient-ready hooks fold
                         each gradient into the flat fp32 buffer and, on the accumulation boundary, launch bucketed
                         reductions that overlap the rest of backward (zero/reducer.py)
  engine.step()        → at the boundary only, ``StepCore``: global norm → overflow check (fp16) → unscale × clip in
                         one multiply → optimizer step (on fp32 masters when mixed precision) → copy back → LR
                         schedule → zero the buffer; then ``EngineEvents`` tells listeners (timers, progress log)

[Note: engine layout] Three layers, so the pipeline's ``train_batch``, monitors and the profiler add code
beside the engine instead of into it: the step core (``training/step_core.py``: what one optimizer step does,
agreed world-wide), loop drivers (``training/micro_driver.py``: when to step, for the user-driven loop), and events
(``training/events.py``: listeners observe phases and finished steps). This file only wires them and keeps
DeepSpeed's method names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.autotuning.probe import attach_autotuning_probe
from shardspeed.comm import CommsLog
from shardspeed.compat import DeepSpeedCompatMixin
from shardspeed.config import ShardSpeedConfig
from shardspeed.data.engine_loader import DifficultyLog, build_training_loader
from shardspeed.distributed import local_rank_device
from shardspeed.engine_module import EngineModule
from shardspeed.engine_setup import (
    bucket_defaults,
    build_engine_optimizer,
    check_param_offload,
    engine_collectives,
    log_engine_summary,
    masters_go_to_optimizer,
    offload_params,
    param_offload_opener,
)
from shardspeed.engine_teardown import destroy_engine
from shardspeed.faults.guard import GUARD_ATTR, EngineGuard, guarded
from shardspeed.faults.preemption import PreemptionWatch
from shardspeed.faults.process import failure_board
from shardspeed.log import configure_logger
from shardspeed.monitor.listener import attach_monitor
from shardspeed.monitor.master import agree_monitor_config
from shardspeed.optim.absent import require_optimizer
from shardspeed.precision.autocast import cast_floats, forward_autocast
from shardspeed.precision.loss_scaler import LossScaler
from shardspeed.precision.policy import memory_precision, optimizer_bytes_per_element
from shardspeed.profiling.engine_profiler import attach_flops_profiler
from shardspeed.schedulers import build_scheduler
from shardspeed.tensor_parallel import bind_collectives, register_partial_grad_hooks
from shardspeed.tensor_parallel.batch_check import FirstBatchCheck
from shardspeed.tensor_parallel.engine_setup import broadcast_initial_state, collect_specs_agreed, tensor_replica_sync
from shardspeed.timers import PhaseTimers
from shardspeed.topology import Topology
from shardspeed.training import EngineEvents, MicroStepDriver, StepCore
from shardspeed.training.curriculum import attach_curriculum
from shardspeed.training.nonfinite import NonFiniteGuard
from shardspeed.training.progress_log import ProgressLog
from shardspeed.utils.safe_access import register_engine_parameters
from shardspeed.zero import build_model_states
from shardspeed.zero.compressed_adam import bind_loss_scale
from shardspeed.zero.compressed_grads import refuse_compression_combination
from shardspeed.zero.grad_sync import CommContext, GradScaling
from shardspeed.zero.memory import allocated_model_states, model_state_bytes
from shardspeed.zero.param_groups import PackedParams, normalize_groups, pack_order
from shardspeed.zero.stage3.init import has_deferred_tensors, to_device_except_deferred
from shardspeed.zero.stage3.save import save_16bit_model as _save_16bit_model


class ShardSpeedEngine(DeepSpeedCompatMixin, EngineModule):
    """DeepSpeed's engine: an ``nn.Module`` wrapping the model as ``module`` ([Note: engine as nn.Module])."""

    _driver_class: type[MicroStepDriver] = MicroStepDriver

    def __init__(
        self,
        model: torch.nn.Module,
        config: ShardSpeedConfig,
        topology: Topology,
        *,
        optimizer: Any = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        refuse_compression_combination(config, optimizer)  # 1-bit optimizer × ZeRO stage: before any collective
        self.topology = topology
        self.logger = configure_logger(topology.global_rank)
        if topology.global_rank == 0:
            for warning in config.warnings:
                self.logger.warning(warning)
        self.device = self._pick_device()
        board = failure_board(config.fault_tolerance)  # [Note: failure propagation] in faults/board.py
        # comms log; interruptible waits (the board); order verification (a debug option)
        self.collectives = engine_collectives(config, topology, board, self.device)
        agree_monitor_config(config, topology, self.collectives)  # the same monitors on every rank, packages import
        bind_collectives(model, self.collectives, topology.tensor)  # tensor-parallel layers: logged, interruptible
        # Specs, then the structure (global shapes) agreed over the world: an error on every rank, not a hang.
        self.param_specs = collect_specs_agreed(model, topology, self.collectives)
        """What each parameter is a piece of ([Note: parameter specs] in params/spec.py)."""
        self._first_batch = FirstBatchCheck(topology.tensor, self.collectives)  # same batch on every tensor rank
        deferred = has_deferred_tensors(model)
        if deferred and config.zero_optimization.stage != 3:
            raise ValueError(
                "the model was built under shardspeed.zero.Init (its parameters are on the meta device); only ZeRO "
                f"stage 3 can materialize it, but zero_optimization.stage is {config.zero_optimization.stage}"
            )
        self.module = to_device_except_deferred(model, self.device)
        if config.compute_dtype != torch.float32:
            self.module.to(dtype=config.compute_dtype)
        self._broadcast_module_state()

        zero = bucket_defaults(config.zero_optimization, self.collectives.algorithms, topology.global_rank == 0)
        groups = normalize_groups(
            optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else model_parameters, self.module
        )
        packed = pack_order(self.module, groups)
        self._check_param_dtypes(packed)
        comm = CommContext(
            axis=topology.data,
            collectives=self.collectives,
            comm_dtype=config.grad_comm_dtype,
            scaling=GradScaling.for_config(
                topology.dp_world_size, config.prescale_gradients, config.gradient_predivide_factor
            ),
        )
        trainable_numel = sum(p.numel() for p in packed.params)
        check_param_offload(config, self.device)  # before the stage attaches its hooks to the module
        if zero.uses_nvme:  # before the model states are allocated: see offload/malloc.py
            from shardspeed.offload.malloc import pin_mmap_threshold

            pin_mmap_threshold()
        sync = tensor_replica_sync(self.param_specs, topology, self.collectives)  # zero.Init with a tensor axis
        open_offload = param_offload_opener(config, topology.data, self.collectives, self.device)  # before values
        to_optimizer = masters_go_to_optimizer(
            config, self.device, optimizer is not None or config.optimizer is not None
        )
        self.states = build_model_states(
            zero, self.module, packed, comm, self.device, config.master_dtype, sync, open_offload, to_optimizer
        )
        offload_params(config, self.states, topology.data, self.collectives, self.device)
        # After the stage: zero.Init's materialization makes new parameter objects ([Note: partial gradients])
        self._tp_grad_hooks = register_partial_grad_hooks(
            self.module, self.param_specs, topology.tensor, self.collectives
        )
        # No optimizer anywhere: an evaluation/inference engine (DeepSpeed allows it; see optim/absent.py).
        host_grads = False  # an offload optimizer with host copies of the gradients scales and forgets them itself
        self.optimizer: Any = None
        if optimizer is not None or config.optimizer is not None:
            self.optimizer, host_grads = build_engine_optimizer(
                config, self.states, optimizer, groups, topology, self.collectives, self.device, self.param_specs
            )
        if self.optimizer is not None:
            # Stages 0-2: buckets are re-laid out from the first backward's arrival order (zero/arrival_order.py).
            self.states.bind_optimizer(self.optimizer, groups)
        self.lr_scheduler = build_scheduler(
            config.scheduler.type if config.scheduler else None,
            config.scheduler.params if config.scheduler else None,
            require_optimizer(self.optimizer, "lr_scheduler") if config.scheduler or lr_scheduler else None,
            lr_scheduler,
        )
        fp16 = config.fp16
        self.loss_scaler = (
            LossScaler(
                dynamic=fp16.loss_scale == 0,
                init_scale=fp16.loss_scale or 2.0**fp16.initial_scale_power,
                window=fp16.loss_scale_window,
                hysteresis=fp16.hysteresis,
                consecutive_hysteresis=fp16.consecutive_hysteresis,
                min_scale=fp16.min_loss_scale,
            )
            if fp16.enabled
            else None
        )
        bind_loss_scale(self.states, self.loss_scaler)  # 1-bit Adam, ZeRO-1/2: compresses unscaled gradients
        # Difficulty sampling when data_efficiency enables it (data/engine_loader.py).
        self.training_dataloader = build_training_loader(training_data, config, topology, collate_fn, self.device)
        self.predicted_memory = model_state_bytes(
            trainable_numel,
            topology.dp_world_size,
            zero.stage,
            precision=memory_precision(config),
            accounting="shardspeed",
            optimizer_state_bytes_per_param=optimizer_bytes_per_element(config, self.optimizer),
            padded_numel=max(self.states.padded_numel, trainable_numel),
        )
        """Model-state bytes this rank should hold (the memory model, shardspeed's accounting); compare with
        ``memory_breakdown()``, which lists what was really allocated."""
        self.timers = PhaseTimers(config.wall_clock_breakdown, self.device, self.collectives.blocked, self.optimizer)
        self.events = EngineEvents()
        """Listeners of this engine's phases and steps (training/events.py): timers, progress log, monitors."""
        self.events.subscribe(self.timers)
        self.events.subscribe(ProgressLog(self.logger, config.steps_per_print, self.timers, topology.global_rank))
        self.events.subscribe(
            DifficultyLog(self.training_dataloader, self.logger, config.steps_per_print, topology.global_rank)
        )
        self.events.subscribe(self.comms_log.expect(config, trainable_numel, topology.dp_world_size))  # comm/log.py
        self.preemption = PreemptionWatch(config.fault_tolerance, self.logger)  # handlers: installed by initialize
        self._core = StepCore(
            states=self.states,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler,
            gradient_clipping=config.gradient_clipping,
            ignore_unused_parameters=zero.ignore_unused_parameters,
            host_grads=host_grads,
            topology=topology,
            param_specs=self.param_specs,
            collectives=self.collectives,
            device=self.device,
            logger=self.logger,
            global_rank=topology.global_rank,
            stop_requested=self.preemption.requested,
            nonfinite=NonFiniteGuard(config.fault_tolerance, self.module),
        )
        self._driver = self._driver_class.for_engine(self)  # PipelineEngine's: train_batch's (pipe_driver.py)
        self.progress = self._driver.progress
        """The loop's counters (``global_steps``, ``micro_steps``, …; DeepSpeed's engine attributes below)."""
        self.flops_profiler = attach_flops_profiler(self)  # DeepSpeed's attribute; inactive unless configured
        attach_autotuning_probe(self)  # autotuning trials: metric JSON + exit after the window (autotuning/probe.py)
        self.monitor = attach_monitor(self)  # DeepSpeed's MonitorMaster: monitors written on one rank (monitor/)
        self.curriculum_scheduler_legacy = attach_curriculum(self)  # DeepSpeed's seqlen curriculum, or None
        self.last_load_stats: dict[str, int] = {}  # files/chunks the last load_checkpoint read on this rank
        register_engine_parameters(self)  # deepspeed.utils.safe_get_full_*(param) find their engine (weakly)
        setattr(self, GUARD_ATTR, EngineGuard(board, topology.global_rank, self.progress))  # last: a whole engine
        if topology.global_rank == 0:
            log_engine_summary(self.logger, config, topology, trainable_numel, self.predicted_memory)

    # --- construction helpers ----------------------------------------------------------------------------------
    def _pick_device(self) -> torch.device:
        device = local_rank_device()  # cuda:LOCAL_RANK, or the CPU; a LOCAL_RANK past the GPUs is a clear error
        if device.type == "cuda":  # as DeepSpeed's engine: current_device() (NCCL's small tensors, streams) is ours
            torch.cuda.set_device(device)
        return device

    @torch.no_grad()
    def _broadcast_module_state(self) -> None:
        """Every rank starts from data-parallel rank 0's replicas (tensor-replicated ones: tensor rank 0's too)."""
        broadcast_initial_state(self.module, self.param_specs, self.topology, self.collectives)

    def _check_param_dtypes(self, packed: PackedParams) -> None:
        expected = self.config.compute_dtype
        for p, name in zip(packed.params, packed.names):
            if p.dtype != expected:
                raise TypeError(f"trainable parameter '{name}' is {p.dtype}; this config trains in {expected}")

    # --- training loop API ---------------------------------------------------------------------------------------
    @guarded("engine.forward()")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if (curriculum := self.curriculum_scheduler_legacy) is not None:  # curriculum_seqlen, or cut (truncate)
            args, kwargs = curriculum.before_forward(self.progress.global_steps, self.module.training, args, kwargs)
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = cast_floats((args, kwargs), self.config.compute_dtype)
        self._first_batch(args, kwargs)  # the first forward only: identical across the tensor axis
        self.events.inputs(args, kwargs)  # the monitors' tokens per sample (no hook on the user's module)
        evaluating = not (self.module.training and torch.is_grad_enabled())  # not training traffic (comm/log.py)
        with (
            self.events.phase("forward"),
            forward_autocast(self.config.torch_autocast, self.device),
            self.comms_log.evaluating(evaluating),
        ):
            return self._driver.passes.watch_outputs(self.module(*args, **kwargs))  # for loss.backward(): 1/GAS

    @guarded("engine.backward()")
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / GAS`` (× loss scale; ``scale_wrt_gas=False``: without 1/GAS); reduces gradients on
        the accumulation boundary. Returns the loss as scaled for accumulation, as DeepSpeed does."""
        require_optimizer(self.optimizer, "backward")
        self._driver.backward(loss, retain_graph, scale_wrt_gas=scale_wrt_gas)
        return loss / self._driver.gradient_accumulation_steps if scale_wrt_gas else loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``: the loss times the fp16 loss scale, for ``scaled.backward()``."""
        require_optimizer(self.optimizer, "scale")
        return self._driver.scale(loss)

    @guarded("engine.step()")
    def step(self, lr_kwargs: dict | None = None) -> None:
        """Optimizer step at the accumulation boundary (``lr_kwargs`` go to the LR scheduler's ``step``);
        otherwise only counts the micro-step."""
        require_optimizer(self.optimizer, "step")
        steps, skipped = self.progress.global_steps, self.progress.skipped_steps
        try:
            self._driver.step(lr_kwargs=lr_kwargs)
        except BaseException:  # a stop agreed at a step that raised is not acted on: the signal stays pending,
            self._core.take_stop()  # so the next boundary agrees it again (never a stale stop mid-accumulation)
            raise
        self._step_applied = self.progress.global_steps > steps and self.progress.skipped_steps == skipped
        self.preemption.after_step(self, self._core.take_stop())  # a stop agreed at this step: save, Preempted

    @guarded("engine.zero_grad()")
    def zero_grad(self) -> None:
        """Forget every gradient accumulated since the last step (as ``module.zero_grad()`` does too)."""
        self._driver.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._driver.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the next backward/step to be (or not be) a boundary, e.g. for a short last window."""
        self._driver.set_boundary(is_boundary)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Skip gradient all-reduce for backward passes inside the context (gradients keep accumulating)."""
        return self._driver.no_sync()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm of the last optimizer step, before clipping (unscaled for fp16). None before the first
        step, and on steps where nothing needed it (no clipping, no fp16, not a steps_per_print step)."""
        return self._driver.global_grad_norm

    @guarded("engine.save_checkpoint()")
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's save_checkpoint: a rank-agnostic checkpoint under ``save_dir/tag`` (default
        ``global_step{N}``), crash-safe, ``latest`` updated last. Every rank must call it. ``client_state`` must be
        plain data (JSON): checkpoints never need unpickling."""
        from shardspeed.checkpoint.engine_io import save

        save(self, save_dir, tag, client_state, save_latest, exclude_frozen=exclude_frozen_parameters)
        return True

    @guarded("engine.load_checkpoint()")
    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict | None]:
        """DeepSpeed's load_checkpoint → ``(load_path, client_state)``; ``(None, None)`` when ``load_dir`` has no
        ``latest`` and no tag is given. Loads checkpoints of any stage and data-parallel world size.
        ``custom_load_fn(src=module_state_dict, dst=module)`` then applies the checkpoint's weights its own way."""
        from shardspeed.checkpoint.engine_io import load

        path, client_state = load(
            self,
            load_dir,
            tag,
            strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        return (str(path) if path is not None else None), client_state

    @guarded("engine.save_16bit_model()")
    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's save_16bit_model: the full state dict in the training dtype, written by rank 0 as
        safetensors (under ZeRO-3 only with stage3_gather_16bit_weights_on_model_save, gathered unit by unit)."""
        return _save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by role: the engine's own list of its buffers.

        ``params`` counts every parameter storage once (tied and frozen included); ``optimizer_states`` every
        tensor in the optimizer's state; the stage's flat buffers appear under their own names (``grads``,
        ``grad_shard``, ``master``/``master_shard``; 1-bit Adam at stages 1/2: ``compression_errors``, built at the
        first compressed step). ``peak_bucket_bytes`` (in-flight gradient buckets of stage 2, gathered units of stage 3)
        is transient and reported apart from the model states.
        """
        return allocated_model_states(self.module, self.states, self.optimizer)

    @property
    def comms_log(self) -> CommsLog:
        return self.collectives.log

    def destroy(self) -> None:
        """Remove the gradient hooks (lets the module be wrapped by another engine) and release offload storage
        (NVMe swap files); put back the signal handlers the engine replaced; close the profiler and monitors."""
        destroy_engine(self)
