"""``PipelineEngine``: DeepSpeed's pipeline engine, what ``initialize(model=PipelineModule(...))`` returns.

It is the base engine (same ZeRO states, optimizer, step core, events, checkpoints) with a second loop driver
(``training/pipe_driver.py``) and the schedule interpreter (``executor.py``). One ``train_batch`` is one optimizer
step over ``gradient_accumulation_steps`` micro-batches:

  train_batch(it)   → schedule for this stage (``pipeline.schedule``: 1F1B, GPipe, interleaved)
                    → executor: load (first/last stage), forward, send/receive activations and gradients (S3's
                      ``PipeChannel``), backward inside the stage's reducer protocol (hold or per micro-batch)
                    → ReduceTiedGrads (tied weights summed over their stages) → ReduceGrads (data axis)
                    → OptimizerStep: the loss aggregated ([Note: pipeline loss]), then ``StepCore.run`` — the
                      gradient norm over every stage and the overflow verdict are agreed over the world already
                    → the mean loss, the same on every stage; ``engine.pipe_stats`` for the batch

``forward``/``backward``/``step`` raise DeepSpeed's error: only ``train_batch``/``eval_batch`` drive a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from shardspeed.config import ShardSpeedConfig
from shardspeed.config.pipeline import ModuleSettings, PipelineConfig, pipeline_config_conflicts
from shardspeed.data.repeating import RepeatingLoader
from shardspeed.engine import ShardSpeedEngine
from shardspeed.faults.errors import mark_agreed
from shardspeed.faults.guard import guarded
from shardspeed.optim.absent import require_optimizer
from shardspeed.pipe.buffers import PipeStepStats
from shardspeed.pipe.data import StageData
from shardspeed.pipe.executor import PipeExecutor
from shardspeed.pipe.links import build_links
from shardspeed.pipe.p2p import PipeChannel
from shardspeed.pipe.schedule import build_schedule
from shardspeed.pipe.tied_sync import sync_tied_materialized
from shardspeed.tensor_parallel.batch_check import BatchMismatchError
from shardspeed.topology import Topology
from shardspeed.training.pipe_driver import PIPELINE_ONLY, PipeDriver, StepHold
from shardspeed.zero.hold import holds_step, micro_batch_warning
from shardspeed.zero.stage3.init import has_deferred_tensors

__all__ = ["PipelineEngine", "PipelineError", "PipelineModel", "is_pipeline_module"]


class PipelineError(RuntimeError):
    """DeepSpeed's ``PipelineError``: an engine method that a pipeline does not offer."""


@runtime_checkable
class PipelineModel(Protocol):
    """What the engine reads of a ``PipelineModule`` (S2)."""

    topology: Topology
    num_stages: int
    stage_id: int
    virtual_stages: int
    loss_fn: Any
    dynamic_shape: bool
    activation_checkpoint_interval: int

    def tied_weights(self) -> list[Any]: ...

    def sync_tied_weights(self, collectives: Any) -> None: ...


def is_pipeline_module(model: Any) -> bool:
    return isinstance(model, torch.nn.Module) and isinstance(model, PipelineModel)


def _check_module(model: Any, topology: Topology, settings: PipelineConfig) -> list[str]:
    """Everything here is decided by the config and the module's structure, the same on every rank: agreed.
    Returns the config's warnings (keys the module decides: config/pipeline.py [Note: the module decides])."""
    if model.num_stages != topology.pipe.size or model.stage_id != topology.pipe.rank:
        raise mark_agreed(
            ValueError(
                f"the PipelineModule has {model.num_stages} stages (this rank: stage {model.stage_id}) but the "
                f"engine's topology has a pipe axis of {topology.pipe.size} (index {topology.pipe.rank}): build the "
                "module on the topology initialize() uses (its topology= argument)"
            )
        )
    errors, warnings = pipeline_config_conflicts(
        settings,
        ModuleSettings(
            num_stages=model.num_stages,
            partition_method=str(getattr(model, "partition_method", "parameters")),
            seed_layers=bool(getattr(model, "seed_layers", False)),
            activation_checkpoint_interval=int(model.activation_checkpoint_interval),
        ),
    )
    if errors:
        raise mark_agreed(ValueError("; ".join(errors)))
    v = model.virtual_stages
    if settings.schedule == "interleaved" and v < 2:
        raise mark_agreed(
            ValueError(
                f'pipeline.schedule "interleaved" needs a PipelineModule with virtual_stages >= 2 (model chunks per '
                f"rank); this one has virtual_stages={v}"
            )
        )
    if settings.schedule != "interleaved" and v != 1:
        raise mark_agreed(
            ValueError(
                f"the PipelineModule has virtual_stages={v} (interleaved model chunks) but pipeline.schedule is "
                f'"{settings.schedule}": set it to "interleaved", or build the module with virtual_stages=1'
            )
        )
    return warnings


def _gather_tied_with_the_stage(model: Any) -> None:
    """ZeRO-3: a tied occurrence with a ``forward_fn`` (a head reading the embedding's weight) never calls the tied
    module, so the stage-3 hooks would not gather its parameters there. Registered as external parameters of the
    pipeline module (DeepSpeed's remedy for a forward reading another module's weight), they are gathered around
    every chunk's forward and backward on the stages holding them; the hold keeps them gathered for the step."""
    from shardspeed.zero import register_external_parameter

    tied = getattr(model, "tied_modules", None)
    for param in tied.parameters() if tied is not None else ():
        register_external_parameter(model, param)


class _NoPeers:
    """The channel of a one-stage pipeline: the schedule never sends or receives."""

    stats = None

    def wait_sends(self) -> None:
        pass

    def reset_shapes(self) -> None:
        pass


class PipelineEngine(ShardSpeedEngine):
    """DeepSpeed's ``PipelineEngine``: ``train_batch``, ``eval_batch``, ``set_dataiterator``, ``is_first_stage``,
    ``is_last_stage``, ``reset_activation_shape``; ``engine.pipe_stats`` after each ``train_batch``,
    ``engine.eval_pipe_stats`` after each ``eval_batch``."""

    _driver_class = PipeDriver

    def __init__(self, model: torch.nn.Module, config: ShardSpeedConfig, topology: Topology, **kwargs: Any) -> None:
        if not is_pipeline_module(model):
            raise TypeError(f"PipelineEngine needs a shardspeed.pipe.PipelineModule, got {type(model).__name__}")
        settings: PipelineConfig = getattr(config, "pipeline", None) or PipelineConfig()
        warnings = _check_module(model, topology, settings)
        try:  # the schedule's own checks (interleaving: micro-batches divisible by the stages), before anything
            build_schedule(
                settings.schedule,
                config.gradient_accumulation_steps,
                model.num_stages,
                model.stage_id,
                model.virtual_stages,
            )
        except ValueError as err:
            raise mark_agreed(
                ValueError(f"gradient_accumulation_steps (the micro-batches of a train_batch): {err}")
            ) from None
        if config.zero_optimization.stage == 3:
            _gather_tied_with_the_stage(model)
        deferred = has_deferred_tensors(model)  # zero.Init: tied copies synced once materialized
        super().__init__(model, config, topology, **kwargs)
        if deferred:
            sync_tied_materialized(self.module, self.collectives)  # [Note: tied sync after materialization]
        for warning in warnings if topology.global_rank == 0 else ():
            self.logger.warning(warning)
        self.pipeline = settings
        """The typed ``pipeline`` config section."""
        self.num_stages, self.stage_id = model.num_stages, model.stage_id
        hold = self._check_hold(model)
        tensor = topology.tensor
        partition = tensor if settings.pipe_partitioned and tensor.size > 1 else None
        if tensor.size > 1 and settings.grad_partitioned != settings.pipe_partitioned and topology.global_rank == 0:
            # One channel carries both kinds (they share each link's FIFO order: instructions.py), so one setting.
            self.logger.warning(
                "pipeline.grad_partitioned=%s differs from pipe_partitioned=%s: gradients between stages follow "
                "pipe_partitioned",
                settings.grad_partitioned,
                settings.pipe_partitioned,
            )
        # One stage has no peers (and a world of one may have no process group at all): nothing to send. Under
        # NCCL each directed link gets its own communicator ([Note: pipeline links]).
        self.channel: Any = (
            PipeChannel(
                self.collectives,
                self.device,
                dynamic_shape=model.dynamic_shape,
                partition=partition,
                links=build_links(topology, model.virtual_stages),
            )
            if self.num_stages > 1
            else _NoPeers()
        )
        self._executor = PipeExecutor(
            module=self.module,
            channel=self.channel,
            pipe_ranks=topology.pipe.ranks,
            stage_id=self.stage_id,
            chunks=model.virtual_stages,
            loss_fn=model.loss_fn,
            events=self.events,
        )
        driver: PipeDriver = self._driver  # type: ignore[assignment]
        driver.bind_pipeline(
            hold=StepHold(self.states),
            per_micro_batch=not hold,
            tied=model.tied_weights(),
            topology=topology,
            collectives=self.collectives,
            device=self.device,
        )
        self.data_iterator: Iterator[Any] | None = None
        if self.training_dataloader is not None:
            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))
        self.agg_train_loss: torch.Tensor | None = None
        """The last ``train_batch``'s loss (DeepSpeed's name)."""
        self.pipe_stats: PipeStepStats | None = None
        """What the last ``train_batch`` spent where on this rank (wait, post, compute, peak live buffers)."""
        self.eval_pipe_stats: PipeStepStats | None = None
        """The same for the last ``eval_batch`` (kept apart: evaluating does not overwrite the training figures)."""

    def _broadcast_module_state(self) -> None:
        """The base engine's initial broadcast, then each tied weight from its owner stage (before the ZeRO stage
        copies the parameters into its buffers and masters)."""
        super()._broadcast_module_state()
        self.module.sync_tied_weights(self.collectives)

    def _check_hold(self, model: Any) -> bool:
        """Whether gradients are held for the step (``pipeline.zero_hold``). Per micro-batch, weights tied across
        stages are refused (zero/hold.py ``holds_step``), by the keys every rank holds: a stage without the tie
        must raise the same error, so the keys are gathered over the world first (only in that mode)."""
        mode = self.pipeline.zero_hold
        warning = micro_batch_warning(mode, self.config.zero_optimization.stage)
        if warning is not None and self.topology.global_rank == 0:
            self.logger.warning(warning)
        keys: set[str] = set()
        if mode == "micro_batch":
            mine = sorted(t.key for t in model.tied_weights() if t.axis.size > 1)
            for theirs in self.collectives.all_gather_object(mine, self.topology.world):
                keys.update(theirs)  # type: ignore[arg-type]
        try:
            return holds_step(mode, sorted(keys))
        except ValueError as err:
            raise mark_agreed(err) from None

    # --- DeepSpeed's pipeline API -----------------------------------------------------------------------------------
    @property
    def micro_batches(self) -> int:
        """Micro-batches per ``train_batch``: ``gradient_accumulation_steps``."""
        return self._driver.gradient_accumulation_steps

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch`` reads when given none (only the first and last stages keep it). An iterable
        that is not an iterator (a list, a loader) is iterated once from here on, not restarted per batch."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator if hasattr(iterator, "__next__") else iter(iterator)

    def reset_activation_shape(self) -> None:
        """Renegotiate activation shapes on the next message of every link (sequence length changed, say)."""
        self.channel.reset_shapes()

    def _curriculum_batch(self) -> Any:
        """The data iterator of this ``train_batch`` ([Note: curriculum renegotiation] in training/curriculum.py)."""
        if (curriculum := self.curriculum_scheduler_legacy) is None:
            return self.data_iterator
        return curriculum.pipeline_batch(self.progress.global_steps, self.data_iterator, self.reset_activation_shape)

    def _stage_data(self, iterator: Any) -> StageData:
        if iterator is not None and not hasattr(iterator, "__next__"):
            iterator = iter(iterator)
        return StageData(
            iterator,
            reads_inputs=self.is_first_stage(),
            reads_labels=self.is_last_stage(),
            device=self.device,
            cast_dtype=self.config.compute_dtype if self.config.fp16.enabled and self.config.fp16.auto_cast else None,
            on_load=self._check_first_batch,
        )

    def _check_first_batch(self, inputs: Any, labels: Any) -> None:
        """The engine's first batch is compared over the tensor axis (``FirstBatchCheck``; only the first load
        does any work). Agreed only within this stage's tensor group, so re-raised unagreed: the failure board
        then stops the other stages waiting on p2p ([Note: failure propagation] in faults/board.py)."""
        try:
            self._first_batch((inputs, labels), {})
        except BatchMismatchError as err:
            raise BatchMismatchError(str(err)) from None

    @guarded("engine.train_batch()")
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches read from ``data_iter`` (default:
        the iterator of ``set_dataiterator`` / the engine's training data). Returns the mean loss over the
        micro-batches and data-parallel ranks, on every stage."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        require_optimizer(self.optimizer, "train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        data = self._stage_data(self._curriculum_batch())  # seqlen curriculum: renegotiate shapes, cut batches
        if data.needed and data.iterator is None:
            raise ValueError(
                "train_batch() has no data: pass data_iter, call set_dataiterator(), or give initialize() training_data"
            )
        m = self.micro_batches
        schedule = build_schedule(self.pipeline.schedule, m, self.num_stages, self.stage_id, self._chunks)
        self.module.train()
        steps, skipped = self.progress.global_steps, self.progress.skipped_steps
        driver: PipeDriver = self._driver  # type: ignore[assignment]
        driver.begin_batch()
        scaler = self._core.loss_scaler
        try:
            with self.events.phase("batch"):  # the monitors' throughput window opens here, as DeepSpeed's timer
                result = self._executor.run(
                    schedule.steps(), data, micro_batches=m, hooks=driver, loss_scale=scaler.scale if scaler else 1.0
                )
        except BaseException:
            driver.abort_batch()
            raise
        self.pipe_stats = result.stats
        self._step_applied = self.progress.global_steps > steps and self.progress.skipped_steps == skipped
        self.preemption.after_step(self, self._core.take_stop())  # a stop agreed at this step: save, Preempted
        assert driver.last_loss is not None
        self.agg_train_loss = driver.last_loss  # DeepSpeed's attribute
        return driver.last_loss

    @property
    def _chunks(self) -> int:
        return int(self.module.virtual_stages)

    @guarded("engine.eval_batch()")
    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """DeepSpeed's ``eval_batch``: forward only (inference schedule, ``torch.no_grad()``) over
        ``num_micro_batches`` (default ``gradient_accumulation_steps``) batches of ``data_iter``. On the last stage
        the losses (``compute_loss``) or outputs, averaged over micro-batches and the data axis
        (``reduce_output="avg"``) or as a list (None); with ``compute_loss`` and ``bcast_loss`` the loss is
        broadcast to every stage (elsewhere None is returned). ``return_logits``: ``(value, last micro-batch's
        outputs)``, the outputs on the last stage only."""
        from shardspeed.pipe.eval import reduce_eval_outputs

        if reduce_output is not None and str(reduce_output).lower() != "avg":
            raise NotImplementedError(f"eval_batch(reduce_output={reduce_output!r}): only 'avg' and None")
        m = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        schedule = build_schedule(self.pipeline.schedule, m, self.num_stages, self.stage_id, self._chunks, train=False)
        self.module.eval()
        if self.curriculum_scheduler_legacy is not None:  # eval runs at its data's length: renegotiate
            self.curriculum_scheduler_legacy.pipeline_eval(self.reset_activation_shape)
        data = self._stage_data(data_iter)
        with torch.no_grad():
            result = self._executor.run(
                schedule.steps(),
                data,
                micro_batches=m,
                compute_loss=compute_loss,
                keep_outputs=return_logits or not compute_loss,
            )
            self.eval_pipe_stats = result.stats
            value = reduce_eval_outputs(
                result,
                compute_loss=compute_loss,
                reduce_output=reduce_output,
                bcast_loss=bcast_loss,
                micro_batches=m,
                topology=self.topology,
                collectives=self.collectives,
                device=self.device,
            )
        if return_logits:
            return value, (result.outputs[-1] if result.outputs else None)
        return value

    # --- what a pipeline does not offer ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(PIPELINE_ONLY)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(PIPELINE_ONLY)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(PIPELINE_ONLY)
