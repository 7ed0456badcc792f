"""``ShardSpeedTrainer``: the Hugging Face ``Trainer`` training through a shardspeed engine.

[Note: HF Trainer integration]
transformers drives DeepSpeed through accelerate: ``TrainingArguments(deepspeed=...)`` makes accelerate's state
``DistributedType.DEEPSPEED``, ``deepspeed_init`` fills the config's ``"auto"`` values, ``accelerator.prepare``
calls ``deepspeed.initialize``, ``accelerator.backward`` calls ``engine.backward`` + ``engine.step``, and the
Trainer's optimizer/scheduler become wrappers whose ``step()`` does nothing. Every one of those steps does
``import deepspeed``. The ways to reach that path without DeepSpeed installed — a module registered as
``deepspeed`` in ``sys.modules``, or patched transformers/accelerate functions — would shadow a real DeepSpeed
(our benchmarks run next to one) and break on every transformers release, so we do neither.

Instead the Trainer runs in its plain (non-DeepSpeed) mode and this subclass overrides the extension points the
Trainer documents for custom training ("Subclass and override"), each doing what the DeepSpeed path does:

- ``create_optimizer_and_scheduler`` only records the number of steps; the optimizer and scheduler are built with
  the engine in ``_wrap_model`` (below), because the Trainer turns on gradient checkpointing between the two calls
  and ZeRO-3 must see the model as it will run.
- ``_wrap_model`` (training) fills the config's ``"auto"`` values from the TrainingArguments (``config.py``, the
  keys and mismatch rule of transformers' ``HfTrainerDeepSpeedConfig``), builds the Trainer's optimizer (its
  weight-decay groups) unless the config has an ``optimizer`` section, and its scheduler (``lr_scheduler_type``,
  warmup) unless the config has a ``scheduler`` section — as transformers' ``deepspeed_optim_sched`` does — calls
  ``shardspeed.initialize``, and returns the engine as a module (``engine_view.EngineModule``). The Trainer then
  holds views whose ``step()`` does nothing (``EngineOptimizer``/``EngineScheduler``): not torch optimizer /
  scheduler subclasses, so ``accelerator.prepare`` passes them through, and the model is not ``self.model``, so
  accelerate wraps nothing in DDP.
- ``training_step`` runs the forward and loss exactly as the Trainer does, then ``engine.backward`` and
  ``engine.step`` (accelerate's ``DeepSpeedEngineWrapper.backward``): the accumulation boundary is the Trainer's
  (``accelerator.sync_gradients``, so a short last window of an epoch steps), and since the Trainer's loss is
  already normalized over the accumulation window (``num_items_in_batch``, or divided by the window length),
  the engine's own ``1/gradient_accumulation_steps`` is skipped: ``engine.backward(loss, scale_wrt_gas=False)``.
- Clipping happens in the engine (``gradient_clipping`` ← ``max_grad_norm``). The Trainer's own
  ``clip_grad_norm_`` is switched off for the loop (``train`` sets ``args.max_grad_norm`` to 0 and restores it):
  between backward passes ``param.grad`` holds the engine's gradient markers ([Note: gradient markers] in
  ``zero/grad_markers.py``), not gradients, and an in-place multiply of a marker is an error. The logged
  ``grad_norm`` is the engine's (``_maybe_log_save_evaluate``).
- Checkpoints: ``save_model`` gathers the full state dict (``engine.module_state_dict()``, collective under
  ZeRO-3, on every rank) and rank 0 writes it with ``save_pretrained`` (so ``from_pretrained`` reloads it);
  optimizer, scheduler and module states go through the engine's rank-agnostic ``save_checkpoint`` into the same
  ``checkpoint-N`` directory (``_save_optimizer_and_scheduler``), and ``train(resume_from_checkpoint=...)`` loads
  them with ``load_checkpoint`` (``_load_optimizer_and_scheduler``) instead of the Trainer's weight loading
  (``_load_from_checkpoint``), which would need whole parameters on every rank. The Trainer still saves and
  restores its own state, RNG states and the data position.
- The model is never moved by the Trainer (``_move_model_to_device``): the engine places it, and a model built
  under ``zero.Init`` has nothing to move.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.optimization import get_scheduler

from shardspeed.integrations.hf.config import TrainerValues, fill_auto, model_hidden_size
from shardspeed.integrations.hf.engine_view import EngineModule, EngineOptimizer, EngineScheduler
from shardspeed.zero.stage3.init import has_deferred_tensors


def _read_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        return json.loads(Path(config).read_text())
    raise TypeError(f"shardspeed_config must be a dict or a path to a DeepSpeed JSON file, got {type(config).__name__}")


class ShardSpeedTrainer(Trainer):
    """``transformers.Trainer`` whose training runs in a shardspeed engine (see [Note: HF Trainer integration]).

    ``shardspeed_config`` is a DeepSpeed JSON (dict or path); ``"auto"`` values are filled from the
    TrainingArguments as transformers does for DeepSpeed. Everything else is the Trainer's own API. Leave
    ``TrainingArguments.deepspeed`` unset: that path imports the ``deepspeed`` package.
    """

    def __init__(self, *args: Any, shardspeed_config: dict[str, Any] | str | os.PathLike[str], **kwargs: Any) -> None:
        self.shardspeed_config = _read_config(shardspeed_config)
        self.engine: Any = None
        self._engine_module: EngineModule | None = None
        self._num_training_steps: int | None = None
        self._max_grad_norm: float | None = None
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise ValueError(
                "ShardSpeedTrainer: TrainingArguments.deepspeed is set, which runs the Trainer through the "
                "deepspeed package; pass the DeepSpeed config as shardspeed_config=... instead"
            )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._max_grad_norm = self.args.max_grad_norm  # the engine clips with it: see [Note: HF Trainer integration]
        self.args.max_grad_norm = 0.0
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.max_grad_norm = self._max_grad_norm

    # --- building the engine -------------------------------------------------------------------------------------
    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        return None  # the engine places the model (and a zero.Init model has no storage to move)

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._num_training_steps = num_training_steps  # both are built with the engine, in _wrap_model

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if self._engine_module is not None:
            return self._engine_module
        if not training:  # evaluation before any training: the plain model (stages 0-2 and a normally built model)
            if has_deferred_tensors(model):
                raise RuntimeError(
                    "ShardSpeedTrainer: evaluation before train() of a model built under zero.Init: its parameters "
                    "are still on the meta device (the engine materializes them when training starts); call "
                    "trainer.train() first, or build the model normally to evaluate it untrained"
                )
            return model
        self._build_engine()
        return self._engine_module

    def _build_engine(self) -> None:
        import shardspeed

        args, steps = self.args, self._num_training_steps
        if steps is None:
            raise RuntimeError("ShardSpeedTrainer: the engine is built by train(); call trainer.train()")
        values = TrainerValues.from_args(args, steps, model_hidden_size(self.model), max_grad_norm=self._max_grad_norm)
        config = fill_auto(self.shardspeed_config, values)
        refuse_autotp(config)
        optimizer = self.optimizer  # Trainer(optimizers=(opt, sched)) wins, as in the Trainer
        if optimizer is None and "optimizer" not in config:
            optimizer = Trainer.create_optimizer(self)  # the Trainer's optimizer with its weight-decay groups
        scheduler: Any = self.lr_scheduler
        if scheduler is None and "scheduler" not in config:

            def scheduler(opt: torch.optim.Optimizer) -> Any:  # built on the engine's optimizer
                return get_scheduler(
                    args.lr_scheduler_type,
                    optimizer=opt,
                    num_warmup_steps=args.get_warmup_steps(steps),
                    num_training_steps=steps,
                    scheduler_specific_kwargs=args.lr_scheduler_kwargs,
                )

        if (config.get("fault_tolerance") or {}).get("auto_resume"):
            raise ValueError(
                "ShardSpeedTrainer: fault_tolerance.auto_resume would restore the engine but not the Trainer's own "
                "step, epoch and data position; resume with trainer.train(resume_from_checkpoint=True) from the "
                "checkpoints save_steps writes instead"
            )
        engine, _, _, _ = shardspeed.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.engine = engine
        self._engine_module = EngineModule(engine)
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = EngineScheduler(engine)

    # --- one micro-step ------------------------------------------------------------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        # No compute_loss_context_manager: it is the Trainer's CPU autocast for bf16, and the engine owns precision.
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if (not self.model_accepts_loss_kwargs or num_items_in_batch is None) and self.compute_loss_func is None:
            loss = loss / self.current_gradient_accumulation_steps  # as the Trainer does
        boundary = bool(self.accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        # The loss is already normalized over the window: the engine must not divide by its GAS again.
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self.lr_scheduler.last_step_lr = engine.get_lr()  # the rate this step uses, which the Trainer logs
        engine.step()
        return loss.detach()

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        if self.engine is not None:
            grad_norm = self.engine.get_global_grad_norm()  # the Trainer's own clip saw already-zeroed gradients
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.engine.module_state_dict()  # every rank: ZeRO-3 gathers unit by unit
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)  # module, optimizer, scheduler: rank-agnostic, every rank writes

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Weights come back with the engine checkpoint in _load_optimizer_and_scheduler, once the engine exists.
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path, _ = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint={checkpoint}: no shardspeed engine checkpoint there (no 'latest' file); "
                "ShardSpeedTrainer resumes from checkpoints it saved"
            )

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        self.engine.load_checkpoint(self.state.best_model_checkpoint, load_module_only=True)


def refuse_autotp(config: dict[str, Any]) -> None:
    """AutoTP under the Trainer is refused: the Trainer's sampler splits batches by global rank and its batch
    arithmetic counts every rank as data-parallel, while tensor-parallel ranks must see the same batch."""
    tp = config.get("tensor_parallel")
    size = tp.get("autotp_size", 0) if isinstance(tp, dict) else 0
    if isinstance(size, int) and not isinstance(size, bool) and size > 1:
        raise NotImplementedError(
            f"ShardSpeedTrainer: tensor_parallel.autotp_size {size} is not supported under the Hugging Face Trainer "
            "yet (its sampler gives every rank a different batch; tensor-parallel ranks need the same one). Train "
            "with shardspeed.initialize and the engine's data loader, or set autotp_size to 0"
        )
