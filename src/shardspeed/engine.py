"""The training engine: orchestration only. It builds the pieces from the typed config and calls them in order.

One training step, traced (see docs/architecture.md):
  engine(x)            → module forward (parameters already in the compute dtype)
  engine.backward(l)   → scale loss by 1/GAS (× loss scale for fp16); gradient-ready hooks fold each gradient
                         into the flat fp32 buffer and, on the accumulation boundary, launch bucketed all-reduces
                         that overlap the rest of backward (zero/bucketed_allreduce.py)
  engine.step()        → at the boundary only: global norm → overflow check (fp16) → unscale × clip in one
                         multiply → optimizer step (on fp32 masters when mixed precision) → copy back → LR
                         schedule → zero the buffer
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardspeed.comm import Collectives, CommsLog
from shardspeed.compat import DeepSpeedCompatMixin
from shardspeed.config import ShardSpeedConfig
from shardspeed.data import build_dataloader
from shardspeed.log import configure_logger
from shardspeed.optim import build_optimizer, is_elementwise
from shardspeed.optim.absent import require_optimizer
from shardspeed.optim.build import prefer_client_optimizer, state_bytes_per_element
from shardspeed.optim.lamb import Lamb
from shardspeed.precision.grad_norm import clip_coefficient
from shardspeed.precision.loss_scaler import LossScaler
from shardspeed.schedulers import build_scheduler
from shardspeed.symmetric import check_same_on_all_ranks, model_fingerprint
from shardspeed.timers import PhaseTimers
from shardspeed.topology import Topology
from shardspeed.zero import build_model_states
from shardspeed.zero.grad_sync import CommContext, GradScaling
from shardspeed.zero.memory import model_state_bytes
from shardspeed.zero.param_groups import PackedParams, normalize_groups, pack_order
from shardspeed.zero.sharded_lamb import ShardedLamb
from shardspeed.zero.stage3.init import has_deferred_tensors, to_device_except_deferred
from shardspeed.zero.stage3.save import save_16bit_model as _save_16bit_model


class ShardSpeedEngine(DeepSpeedCompatMixin):
    """DeepSpeed-compatible engine for ZeRO stage 0 (plain data parallelism with bucketed, overlapped all-reduce)."""

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
        self.config = config
        self.topology = topology
        self.logger = configure_logger(topology.global_rank)
        if topology.global_rank == 0:
            for warning in config.warnings:
                self.logger.warning(warning)
        self.device = self._pick_device()
        self.collectives = Collectives(CommsLog(config.comms_logger.enabled, tuple(config.comms_logger.prof_ops)))

        # Symmetric check before the first collective: a model that differs between ranks is an error, not a hang.
        check_same_on_all_ranks(model_fingerprint(model), topology.data, self.collectives, what="model structure")
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

        zero = config.zero_optimization
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
        self._check_param_offload()  # before the stage attaches its hooks to the module
        if zero.uses_nvme:  # before the model states are allocated: see offload/malloc.py
            from shardspeed.offload.malloc import pin_mmap_threshold

            pin_mmap_threshold()
        self.states = build_model_states(zero, self.module, packed, comm, self.device)
        self._offload_params()
        self._host_grads: Any = None  # offload's HostGradients, when gradients are copied to the host per bucket
        # No optimizer anywhere: an evaluation/inference engine (DeepSpeed allows it; see optim/absent.py).
        self.optimizer = (
            None if optimizer is None and config.optimizer is None else self._build_optimizer(optimizer, groups)
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
        self.training_dataloader = (
            build_dataloader(
                training_data,
                micro_batch_size=config.train_micro_batch_size_per_gpu,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                dp_rank=topology.dp_rank,
                dp_world_size=topology.dp_world_size,
                collate_fn=collate_fn,
                seed=config.seed if config.seed is not None else 0,
                device=self.device,
            )
            if training_data is not None
            else None
        )
        self.predicted_memory = model_state_bytes(
            trainable_numel,
            topology.dp_world_size,
            zero.stage,
            precision="fp32" if config.compute_dtype == torch.float32 else "mixed",
            accounting="shardspeed",
            optimizer_state_bytes_per_param=(state_bytes_per_element(self.optimizer) if self.optimizer else 0)
            + (4 if config.compute_dtype != torch.float32 else 0),
            padded_numel=max(self.states.padded_numel, trainable_numel),
        )
        """Model-state bytes this rank should hold (the memory model, shardspeed's accounting); compare with
        ``memory_breakdown()``, which lists what was really allocated."""
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._global_grad_norm: float | None = None
        self._last_loss: torch.Tensor | None = None
        self._last_log = (time.perf_counter(), 0)
        self.last_load_stats: dict[str, int] = {}
        self.timers = PhaseTimers(
            config.wall_clock_breakdown, self.device
        )  # files/chunks the last load_checkpoint read on this rank
        if topology.global_rank == 0:
            self.logger.info(
                "stage %d, %s, world %d (data %d), %d trainable parameters, micro batch %d × GAS %d × data %d = %d",
                zero.stage,
                config.compute_dtype,
                topology.shape.world_size,
                topology.dp_world_size,
                trainable_numel,
                config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps,
                topology.dp_world_size,
                config.train_batch_size,
            )
            mb = self.predicted_memory
            self.logger.info(
                "model states per rank (predicted): params %.1f MB + grads %.1f MB + optimizer %.1f MB = %.1f MB",
                mb.params / 2**20,
                mb.grads / 2**20,
                mb.optimizer / 2**20,
                mb.total() / 2**20,
            )

    # --- construction helpers ----------------------------------------------------------------------------------
    def _pick_device(self) -> torch.device:
        if torch.cuda.is_available():
            import os

            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    @torch.no_grad()
    def _broadcast_module_state(self) -> None:
        """Every rank starts from data-parallel rank 0's parameters and buffers (as DeepSpeed does)."""
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            if not tensor.is_meta:  # zero.Init: stage 3 broadcasts each unit as it materializes it
                self.collectives.broadcast(tensor.data, self.topology.data, 0, tag="init")

    def _check_param_dtypes(self, packed: PackedParams) -> None:
        expected = self.config.compute_dtype
        for p, name in zip(packed.params, packed.names):
            if p.dtype != expected:
                raise TypeError(f"trainable parameter '{name}' is {p.dtype}; this config trains in {expected}")

    def _build_optimizer(self, user_optimizer: Any, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The optimizer over the tensors this stage steps (masters, shards), keeping the user's groups."""
        cfg = self.config.optimizer
        cfg = cfg if cfg is None or prefer_client_optimizer(cfg.type, user_optimizer) else None
        masters_access = self._hand_masters_to_optimizer()
        stepped = self.states.optimizer_groups(groups)
        if isinstance(user_optimizer, torch.optim.Optimizer):
            swapped = any(a["params"] is not b["params"] for a, b in zip(groups, stepped))
            if swapped and user_optimizer.state:
                raise ValueError("pass a fresh optimizer: it already has state for parameters shardspeed re-homes")
            for group, new in zip(user_optimizer.param_groups, stepped):
                group["params"] = new["params"]
            optimizer = user_optimizer
        else:
            optimizer = build_optimizer(cfg.type if cfg else None, cfg.params if cfg else None, stepped, user_optimizer)
        stage = self.config.zero_optimization.stage
        if stage > 0 and type(optimizer) is Lamb:
            # Lamb's trust ratio needs whole-parameter norms: sum them across shards (one small all-reduce).
            axis, collectives = self.topology.data, self.collectives
            optimizer = ShardedLamb.replacing(
                optimizer,
                self.states.tensor_segments(),
                num_params=self.states.num_params,
                all_reduce_sum=lambda t: collectives.all_reduce(t, axis, tag="lamb_norms"),
            )
        elif stage > 0 and not is_elementwise(optimizer) and not self.config.zero_allow_untested_optimizer:
            raise ValueError(
                f"ZeRO stage {stage} steps flat shards, which is only correct for element-wise optimizers; "
                f"{type(optimizer).__name__} is not known to be element-wise. Set "
                '"zero_allow_untested_optimizer": true to run it anyway.'
            )
        return self._offload(optimizer, masters_access)

    def _hand_masters_to_optimizer(self) -> Any:
        """Mixed precision with a streamed offload optimizer: the fp32 masters live only in its store (host memory
        or NVMe), not here too. Returns the access to the stand-ins' low-precision values, or None."""
        from shardspeed.zero.stage3.param_offload import needs_offloader

        offload = self.config.zero_optimization.offload_optimizer
        hand_over = getattr(self.states, "hand_masters_to_optimizer", None)
        if offload is None or hand_over is None or not needs_offloader(offload.device, self.device.type != "cpu"):
            return None
        return hand_over()

    def _check_param_offload(self) -> None:
        from shardspeed.zero.stage3.param_offload import check_param_offload

        zero = self.config.zero_optimization
        device = zero.offload_param.device if zero.offload_param is not None else "none"
        optimizer_device = zero.offload_optimizer.device if zero.offload_optimizer is not None else "none"
        check_param_offload(
            device, zero.stage, self.config.compute_dtype != torch.float32, self.device.type != "cpu", optimizer_device
        )

    def _offload_params(self) -> None:
        """``offload_param`` (stage 3): parameter shards move to host memory or a swap file between uses
        (``max_in_cpu`` of them stay in host memory; ``buffer_count`` × ``buffer_size`` bound the host buffers
        shards are read from NVMe into)."""
        from shardspeed.zero.stage3.param_offload import build_param_offloader, needs_offloader

        zero = self.config.zero_optimization
        offload = zero.offload_param
        if offload is None or not needs_offloader(offload.device, self.device.type != "cpu"):
            return
        axis, collectives = self.topology.data, self.collectives
        offloader = build_param_offloader(
            [u for u in self.states.units if not u.persistent],
            offload.device,
            nvme_path=offload.nvme_path,
            pin_memory=offload.pin_memory,
            settings=self.config.aio.settings(),
            rank=axis.rank,
            agree=lambda obj: collectives.all_gather_object(obj, axis),
            buffer_count=offload.buffer_count,
            buffer_size=offload.buffer_size,
            max_in_cpu=offload.max_in_cpu,
            prefetch_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
        )
        self.states.offload_params(offloader)

    def _offload(self, optimizer: torch.optim.Optimizer, masters: Any) -> Any:
        """``offload_optimizer``: the step and its states move to the host (cpu) or a swap file (nvme). ``masters``:
        the access to stand-ins for masters the stage handed over (``_hand_masters_to_optimizer``), or None."""
        zero = self.config.zero_optimization
        offload = zero.offload_optimizer
        if offload is None or offload.device == "none":
            return optimizer
        from shardspeed.offload.wrap import offload_optimizer

        axis, collectives = self.topology.data, self.collectives
        streamed = offload_optimizer(
            optimizer,
            offload,
            settings=self.config.aio.settings(),
            chunk_numel=zero.sub_group_size,
            rank=axis.rank,
            agree=lambda obj: collectives.all_gather_object(obj, axis),
            # stand-in tensors: ZeRO-3 fp32 offload_param, or mixed precision whose masters the optimizer holds
            access=masters if masters is not None else getattr(self.states, "stepped_access", None),
            values_in_store=masters is not None,
        )
        if hasattr(self.states, "master_store") and hasattr(streamed, "reseed"):
            self.states.master_store = streamed  # it holds the fp32 values: GatheredParameters edits must reach it
        self._host_grads = getattr(streamed, "host_grads", None)
        if self._host_grads is not None:  # each bucket's final gradient starts its copy to the host at once
            self.states.set_final_grads_hook(streamed.stage_grads)
        return streamed

    # --- training loop API ---------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), self.config.compute_dtype)
        with self.timers.phase("forward"):
            return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss / GAS`` (× loss scale); reduces gradients on the accumulation boundary."""
        require_optimizer(self.optimizer, "backward")
        if loss.numel() != 1:
            raise ValueError(f"backward expects a scalar loss, got shape {tuple(loss.shape)}")
        self._last_loss = loss.detach()
        scale = 1.0 / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        boundary = self.is_gradient_accumulation_boundary()
        communicate = (boundary or self.states.communicate_every_micro_step) and not self._no_sync
        reducer = self.states.reducer
        if self._host_grads is not None and boundary and communicate:
            self.optimizer.forget_grads()  # a step that raised or was skipped leaves no copies or scale behind
        reducer.before_backward(communicate, final=boundary)
        with self.timers.phase("backward"):
            try:
                (loss.float() * scale).backward(retain_graph=retain_graph)
            except BaseException as err:
                reducer.abort_backward()
                # ZeRO-3 names a parameter read as an empty placeholder; anything else is raised as it came
                explained = self.states.explain_backward_error(err, loss)
                if explained is err:
                    raise
                raise explained from err
            reducer.after_backward()
        return loss

    def step(self) -> None:
        """Optimizer step at the accumulation boundary; otherwise only counts the micro-step."""
        require_optimizer(self.optimizer, "step")
        if self.is_gradient_accumulation_boundary():
            with self.timers.phase("step"):
                self._boundary_step()
        self.micro_steps += 1
        self._boundary_override = None

    def _boundary_step(self) -> None:
        if not self.states.reducer.reduced:
            raise RuntimeError(
                "step() at a gradient-accumulation boundary, but this step's gradients were never all-reduced: the "
                "boundary backward ran under no_sync() or as loss.backward() instead of engine.backward(loss). "
                "Ranks would step on different gradients and diverge."
            )
        self.states.verify_unit_order()  # ZeRO-3's deferred unit-id checks
        if not self.config.zero_optimization.ignore_unused_parameters:
            self._check_no_unused_parameters()
        loss_scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        # The norm costs a pass over the gradients and a host sync (plus an all-reduce when sharded), so, as in
        # DeepSpeed, it is computed only when something uses it: clipping, fp16 overflow detection, or the log
        # line of this step. Identical on every rank, so the overflow verdict is too.
        logging_step = (self.global_steps + 1) % self.config.steps_per_print == 0
        needed = self.config.gradient_clipping > 0 or self.loss_scaler is not None or logging_step
        norm = math.sqrt(self.states.grad_sq_sum()) / loss_scale if needed else 0.0
        self._global_grad_norm = norm if needed else None
        overflow = not math.isfinite(norm)
        if overflow and self.loss_scaler is None:
            self.logger.warning(
                "step %d: gradient norm is %s; stepping anyway (no fp16 loss scaler)", self.global_steps, norm
            )
        if overflow and self.loss_scaler is not None:
            message = self.loss_scaler.update(overflow=True)
            self.skipped_steps += 1
            if self.topology.global_rank == 0 and message:
                self.logger.info("step %d: %s", self.global_steps, message)
        else:
            coef = clip_coefficient(norm, self.config.gradient_clipping) / loss_scale
            if coef != 1.0:  # offload with host copies of the gradients: the optimizer scales those
                (self.states.scale_grads if self._host_grads is None else self.optimizer.scale_grads)(coef)
            self.optimizer.step()
            self.states.after_optimizer_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.loss_scaler is not None:
                self.loss_scaler.update(overflow=False)
        self.states.zero_grads()
        if self._host_grads is not None:
            self.optimizer.forget_grads()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        if self.global_steps % self.config.steps_per_print == 0:
            self._log_progress()

    def _check_no_unused_parameters(self) -> None:
        """``ignore_unused_parameters: false``: every rank learns whether any rank saw an unused parameter (one
        scalar all-reduce, issued on every rank), so all ranks raise together instead of some hanging."""
        unused = self.states.reducer.unused_names()
        flag = torch.tensor([float(len(unused))], device=self.device)
        self.collectives.all_reduce_max(flag, self.topology.data, tag="unused_check")
        if flag.item() > 0:
            where = f"here: {', '.join(unused[:5])}" if unused else "on another data-parallel rank"
            raise RuntimeError(
                f"parameters received no gradient this step ({where}) and zero_optimization."
                "ignore_unused_parameters is false; set it to true (the default) to give them zero gradients"
            )

    def _log_progress(self) -> None:
        now = time.perf_counter()
        then, samples_then = self._last_log
        self._last_log = (now, self.global_samples)
        breakdown = self.timers.report_and_reset(self.config.steps_per_print) if self.timers.enabled else None
        if self.topology.global_rank != 0:
            return
        rate = (self.global_samples - samples_then) / max(now - then, 1e-9)
        loss = float(self._last_loss) if self._last_loss is not None else float("nan")
        scale = f", loss scale {self.loss_scaler.scale:g}" if self.loss_scaler else ""
        if breakdown:
            self.logger.info("step %d: %s", self.global_steps, breakdown)
        self.logger.info(
            "step %d: loss %.4f, lr %s, grad norm %.4g%s, %.1f samples/s",
            self.global_steps,
            loss,
            ", ".join(f"{lr:.3g}" for lr in self.get_lr()),
            self._global_grad_norm or 0.0,
            scale,
            rate,
        )

    def zero_grad(self) -> None:
        self.states.zero_grads()

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the next backward/step to be (or not be) a boundary, e.g. for a short last window."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient all-reduce for backward passes inside the context (gradients keep accumulating)."""
        if self.states.communicate_every_micro_step:
            raise RuntimeError(
                "no_sync() cannot be used with ZeRO stage 2: gradients are reduce-scattered into shards on every "
                "backward (as in DeepSpeed). Use gradient_accumulation_steps instead."
            )
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def train(self, mode: bool = True) -> ShardSpeedEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ShardSpeedEngine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm of the last optimizer step, before clipping (unscaled for fp16). None before the first
        step, and on steps where nothing needed it (no clipping, no fp16, not a steps_per_print step)."""
        return self._global_grad_norm

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True
    ) -> bool:
        """DeepSpeed's save_checkpoint: a rank-agnostic checkpoint under ``save_dir/tag`` (default
        ``global_step{N}``), crash-safe, ``latest`` updated last. Every rank must call it. ``client_state`` must be
        plain data (JSON): checkpoints never need unpickling."""
        from shardspeed.checkpoint.engine_io import save

        save(self, save_dir, tag, client_state, save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """DeepSpeed's load_checkpoint → ``(load_path, client_state)``; ``(None, None)`` when ``load_dir`` has no
        ``latest`` and no tag is given. Loads checkpoints of any stage and data-parallel world size."""
        from shardspeed.checkpoint.engine_io import load

        path, client_state = load(
            self,
            load_dir,
            tag,
            strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        return (str(path) if path is not None else None), client_state

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's save_16bit_model: the full state dict in the training dtype, written by rank 0 as
        safetensors (under ZeRO-3 only with stage3_gather_16bit_weights_on_model_save, gathered unit by unit)."""
        return _save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state dict. Under ZeRO-3 parameters are gathered unit by unit (every rank must call
        this); other stages hold whole parameters and return ``module.state_dict()``."""
        full_state_dict = getattr(self.states, "full_state_dict", None)
        return full_state_dict(self.module) if full_state_dict else self.module.state_dict()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by role: the engine's own list of its buffers.

        ``params`` counts every parameter storage once (tied and frozen included); ``optimizer_states`` every
        tensor in the optimizer's state; the stage's flat buffers appear under their own names (``grads``,
        ``grad_shard``, ``master``/``master_shard``). ``peak_bucket_bytes``
        (in-flight gradient buckets of stage 2, gathered units of stage 3)
        is transient and reported apart from the model states.
        """
        out = {"params": _unique_storage_bytes(self.module.parameters())}
        for role, tensors in self.states.buffers().items():
            if role != "params":
                tensors = tensors if isinstance(tensors, list) else [tensors]
                out[role] = sum(t.numel() * t.element_size() for t in tensors)
        opt_state = self.optimizer.state.values() if self.optimizer is not None else ()
        states = [t for s in opt_state for t in s.values() if isinstance(t, torch.Tensor)]
        # a streamed (offloaded) optimizer's state lives in its store; what it keeps on the device it reports
        out["optimizer_states"] = _unique_storage_bytes(states) + getattr(self.optimizer, "resident_state_bytes", 0)
        out["peak_bucket_bytes"] = self.states.peak_bucket_bytes
        return out

    @property
    def comms_log(self) -> CommsLog:
        return self.collectives.log

    def destroy(self) -> None:
        """Remove the gradient hooks (lets the module be wrapped by another engine) and release offload storage
        (NVMe swap files)."""
        self.states.reducer.remove_hooks()
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()
        close_states = getattr(self.states, "close", None)  # stage 3 parameter offload
        if close_states is not None:
            close_states()


def _unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
