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
from shardspeed.optim import build_optimizer
from shardspeed.precision.grad_norm import clip_coefficient, sum_of_squares
from shardspeed.precision.loss_scaler import LossScaler
from shardspeed.precision.master import MasterWeights
from shardspeed.schedulers import build_scheduler
from shardspeed.symmetric import check_same_on_all_ranks, model_fingerprint
from shardspeed.topology import Topology
from shardspeed.zero.bucketed_allreduce import BucketedAllReduce, GradScaling
from shardspeed.zero.grad_buffer import FlatGradBuffer


def _trainable(module: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[str]]:
    """Trainable parameters in registration order, each once (tied parameters appear under their first name)."""
    params, names = [], []
    for name, p in module.named_parameters():  # named_parameters already de-duplicates shared parameters
        if p.requires_grad:
            params.append(p)
            names.append(name)
    return params, names


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
        self.module = model.to(self.device)
        if config.compute_dtype != torch.float32:
            self.module.to(dtype=config.compute_dtype)
        self._broadcast_module_state()

        params, names = _trainable(self.module)
        mixed = config.compute_dtype != torch.float32
        self._check_param_dtypes(params, names)
        # Flat buffer in reverse registration order: roughly the order backward produces gradients, so buckets fill
        # front to back and launch early.
        order = list(reversed(range(len(params))))
        params, names = [params[i] for i in order], [names[i] for i in order]
        zero = config.zero_optimization
        self.grad_buffer = FlatGradBuffer(params, torch.float32, as_views=not mixed, device=self.device)
        self.reducer = BucketedAllReduce(
            params,
            names,
            buffer=self.grad_buffer,
            bucket_numel=int(zero.reduce_bucket_size),
            comm_dtype=config.communication_data_type or torch.float32,
            axis=topology.data,
            collectives=self.collectives,
            scaling=GradScaling.for_config(
                topology.dp_world_size, config.prescale_gradients, config.gradient_predivide_factor
            ),
        )
        self.master = MasterWeights(params, self.grad_buffer) if mixed else None
        self.optimizer = self._build_optimizer(optimizer, model_parameters, params)
        self.lr_scheduler = build_scheduler(
            config.scheduler.type if config.scheduler else None,
            config.scheduler.params if config.scheduler else None,
            self.optimizer,
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
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._global_grad_norm: float | None = None
        self._last_loss: torch.Tensor | None = None
        self._last_log = (time.perf_counter(), 0)
        if topology.global_rank == 0:
            self.logger.info(
                "stage %d, %s, world %d (data %d), %d trainable parameters, micro batch %d × GAS %d × data %d = %d",
                zero.stage,
                config.compute_dtype,
                topology.shape.world_size,
                topology.dp_world_size,
                sum(p.numel() for p in params),
                config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps,
                topology.dp_world_size,
                config.train_batch_size,
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
            self.collectives.broadcast(tensor.data, self.topology.data, 0, tag="init")

    def _check_param_dtypes(self, params: list[torch.nn.Parameter], names: list[str]) -> None:
        expected = self.config.compute_dtype
        for p, name in zip(params, names):
            if p.dtype != expected:
                raise TypeError(f"trainable parameter '{name}' is {p.dtype}; this config trains in {expected}")

    def _build_optimizer(
        self, user_optimizer: Any, model_parameters: Iterable[Any] | None, params: list
    ) -> torch.optim.Optimizer:
        cfg = self.config.optimizer
        groups = list(model_parameters) if model_parameters is not None else list(reversed(params))
        optimizer = build_optimizer(cfg.type if cfg else None, cfg.params if cfg else None, groups, user_optimizer)
        # Frozen parameters may sit in the optimizer (they never get a gradient, so never move); anything that is
        # not a parameter of this module would silently train without its gradient being averaged.
        owned = {id(p) for p in self.module.parameters()}
        if self.master is not None:
            owned |= {id(m) for m in self.master.masters}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    raise ValueError(
                        f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a trainable parameter "
                        "of the model passed to initialize(); its gradient would never be reduced"
                    )
        if self.master is not None:
            # The optimizer steps the fp32 masters; swap them in, group by group, keeping hyperparameters.
            if optimizer.state:
                raise ValueError(
                    "pass a fresh optimizer with mixed precision: it already has state for fp16/bf16 params"
                )
            for group in optimizer.param_groups:
                group["params"] = [self.master.master_of.get(id(p), p) for p in group["params"]]
        return optimizer

    # --- training loop API ---------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), self.config.compute_dtype)
        return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss / GAS`` (× loss scale); reduces gradients on the accumulation boundary."""
        if loss.numel() != 1:
            raise ValueError(f"backward expects a scalar loss, got shape {tuple(loss.shape)}")
        self._last_loss = loss.detach()
        scale = 1.0 / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        sync = self.is_gradient_accumulation_boundary() and not self._no_sync
        self.reducer.before_backward(sync)
        try:
            (loss.float() * scale).backward(retain_graph=retain_graph)
        except BaseException:
            self.reducer.abort_backward()
            raise
        self.reducer.after_backward()
        return loss

    def step(self) -> None:
        """Optimizer step at the accumulation boundary; otherwise only counts the micro-step."""
        if self.is_gradient_accumulation_boundary():
            self._boundary_step()
        self.micro_steps += 1
        self._boundary_override = None

    def _boundary_step(self) -> None:
        if not self.reducer.reduced:
            raise RuntimeError(
                "step() at a gradient-accumulation boundary, but this step's gradients were never all-reduced: the "
                "boundary backward ran under no_sync() or as loss.backward() instead of engine.backward(loss). "
                "Ranks would step on different gradients and diverge."
            )
        flat = self.grad_buffer.flat
        loss_scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        # Reduced gradients are identical on every rank, so the norm (and the overflow verdict) is too: no collective.
        norm = math.sqrt(sum_of_squares([flat]).item()) / loss_scale
        self._global_grad_norm = norm
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
            if coef != 1.0:
                flat.mul_(coef)
            self.optimizer.step()
            if self.master is not None:
                self.master.copy_to_model()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.loss_scaler is not None:
                self.loss_scaler.update(overflow=False)
        self.reducer.zero()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        if self.global_steps % self.config.steps_per_print == 0:
            self._log_progress()

    def _log_progress(self) -> None:
        now = time.perf_counter()
        then, samples_then = self._last_log
        self._last_log = (now, self.global_samples)
        if self.topology.global_rank != 0:
            return
        rate = (self.global_samples - samples_then) / max(now - then, 1e-9)
        loss = float(self._last_loss) if self._last_loss is not None else float("nan")
        scale = f", loss scale {self.loss_scaler.scale:g}" if self.loss_scaler else ""
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
        self.reducer.zero()

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
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm of the last optimizer step, before clipping (unscaled for fp16); None before the first."""
        return self._global_grad_norm

    @property
    def comms_log(self) -> CommsLog:
        return self.collectives.log

    def destroy(self) -> None:
        """Remove the gradient hooks (lets the module be wrapped by another engine)."""
        self.reducer.remove_hooks()


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
