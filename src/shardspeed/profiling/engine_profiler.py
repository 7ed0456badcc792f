"""``engine.flops_profiler``: DeepSpeed's config-driven profiler as an ``EngineListener`` (training/events.py).

Every rank profiles the same optimizer step — the one taken after ``profile_step`` steps, DeepSpeed's rule — from
its first ``forward`` phase to its ``on_step``: every micro-batch's forward and backward (gradient accumulation,
and each forward / backward a pipeline stage runs in ``train_batch``) and the optimizer step. Then it turns itself
off for good (IDLE → PROFILING → DONE).

[Note: the whole-model figure] Each rank counts what it executed: its pipeline stage, its tensor-parallel slices.
At the end of the profiled step every rank all-reduces a few numbers (its forward, backward and recomputed FLOPs,
and its share of the parameters) over the ``model`` scope (pipe × tensor), so the sums cover one whole model
replica; data-parallel replicas compute the same model on other samples and are not added. Per sample = the sum
divided by the samples each rank of the replica processed in the step (``micro batch × gradient accumulation``).
The call is symmetric: ``profile_step`` comes from the config, so every rank reaches it at the same step, and a
size-1 scope is no collective at all. Work a tensor-parallel layer replicates (norms, a replicated head) is
counted on every tensor rank, which the whole-model FLOPs then include T times; parameters are counted once
(tensor rank 0 enters every parameter's global count). A weight tied across pipeline stages counts once (its
copies on later stages are the specs' ``tied_copies``).

``model_flops_per_sample`` excludes activation-checkpointing recompute (it is measured, see session.py); the
printed hardware lines follow DeepSpeed's ``recompute_fwd_factor`` rule.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardspeed.config.flops_profiler import FlopsProfilerConfig
from shardspeed.profiling.mfu import PeakFlops, model_flops_utilization, peak_flops
from shardspeed.profiling.session import ProfileSession, WindowFigures, full_param_count, warm_up_mode
from shardspeed.profiling.summary import EngineContext, render_profile

__all__ = ["EngineFlopsProfiler", "attach_flops_profiler"]

logger = logging.getLogger(__name__)


class EngineFlopsProfiler:
    """The engine's profiler (S5). Inactive unless ``flops_profiler.enabled``."""

    def __init__(
        self,
        config: FlopsProfilerConfig,
        module: nn.Module,
        *,
        topology: Any,
        collectives: Any,
        device: torch.device,
        compute_dtype: torch.dtype,
        steps_done: Callable[[], int],
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        param_specs: Any = None,
        printer: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.module = module
        self.topology = topology
        self.collectives = collectives
        self.device = device
        self.compute_dtype = compute_dtype
        self._steps_done = steps_done
        self.samples_per_rank = micro_batch_size * gradient_accumulation_steps
        self.micro_batch_size = micro_batch_size
        self.param_specs = param_specs
        self._print = printer
        self.state = "IDLE" if config.enabled else "DONE"
        self.session: ProfileSession | None = None
        self.figures: WindowFigures | None = None
        """This rank's figures of the profiled step (None before)."""
        self.model_flops_per_sample: float | None = None
        """Forward + backward FLOPs of the whole model per sample, no recompute; None before profiling (S5)."""
        self.model_params: int | None = None
        self.summary: list[str] = []
        """The printed lines (every rank renders them; rank 0 prints and writes ``output_file``)."""
        self._peak: PeakFlops | None = None
        if config.enabled:
            warm_up_mode()  # the first FlopCounterMode use imports torch._dynamo (seconds): now, not mid-run

    # --- S5 ----------------------------------------------------------------------------------------------------
    @property
    def peak_flops(self) -> float:
        """Peak FLOPS of one device for the compute dtype (table or probe; measured lazily, cached)."""
        return self._peak_figure().flops_per_second

    @property
    def peak_source(self) -> str:
        return self._peak_figure().source

    def _peak_figure(self) -> PeakFlops:
        if self._peak is None:
            self._peak = peak_flops(self.device, self.compute_dtype)
        return self._peak

    # --- EngineListener ----------------------------------------------------------------------------------------
    def on_phase_start(self, phase: str) -> None:
        if self.state == "IDLE" and phase == "forward" and self._steps_done() == self.config.profile_step:
            self.session = ProfileSession(self.module, self.device, self._param_count)
            self.session.start()
            self.state = "PROFILING"
        if self.state == "PROFILING":
            assert self.session is not None
            self.session.begin_phase(phase)

    def on_phase_end(self, phase: str) -> None:
        if self.state == "PROFILING":
            assert self.session is not None
            self.session.end_phase(phase)

    def on_step(self, report: Any) -> None:
        if self.state != "PROFILING":
            return
        assert self.session is not None
        self.session.stop()
        self.state = "DONE"
        self.figures = fig = self.session.figures()
        self.session = None  # the module references and hooks go with it
        self._finish(fig)

    def close(self) -> None:
        """Drop an open window (the engine is destroyed mid-profile)."""
        if self.session is not None:
            self.session.stop()
            self.session = None
        self.state = "DONE"

    # --- internals ---------------------------------------------------------------------------------------------
    def _param_count(self, param: nn.Parameter) -> int:
        return full_param_count(param)

    def _model_share(self) -> int:
        """This rank's share of the replica's parameters ([Note: the whole-model figure]): tensor rank 0 enters each
        parameter's global count (a slice's whole tensor, a replicated one once), the other tensor ranks nothing."""
        if self.topology.tensor.rank != 0:
            return 0
        tied = self.param_specs.tied_copies if self.param_specs is not None else frozenset()
        share = 0
        for name, param in self.module.named_parameters():
            if name in tied:
                continue
            spec = self.param_specs.of(param, name) if self.param_specs is not None else None
            share += math.prod(spec.global_shape) if spec is not None and spec.partitioned else full_param_count(param)
        return share

    def _finish(self, fig: WindowFigures) -> None:
        local = torch.tensor(
            [fig.flops("forward"), fig.flops("backward"), fig.recompute_flops, self._model_share()],
            dtype=torch.int64,  # exact: FLOP counts pass 2**53 on large models
            device=self.device,
        )
        self.collectives.all_reduce(local, self.topology.model, tag="flops_profiler").wait()
        fwd, bwd, recompute, params = (int(v) for v in local.tolist())
        self.model_flops_per_sample = (fwd + bwd - recompute) / self.samples_per_rank
        self.model_params = params
        world = self.topology.world.size
        samples_per_step = self.samples_per_rank * self.topology.data.size
        writes = self.topology.global_rank == 0
        mfu = None
        if writes and fig.wall_seconds > 0:
            mfu = model_flops_utilization(
                self.model_flops_per_sample, samples_per_step / fig.wall_seconds, world, self.peak_flops
            )
        context = EngineContext(
            world_size=world,
            dp_size=self.topology.data.size,
            mp_size=self.topology.model.size,
            micro_batch_size=self.micro_batch_size,
            samples_per_step=samples_per_step,
            recompute_fwd_factor=self.config.recompute_fwd_factor,
            model_params=self.model_params,
            model_fwd_flops=fwd,
            model_flops_per_sample=self.model_flops_per_sample,
            peak_flops=self.peak_flops if writes else None,
            peak_source=self.peak_source if writes else "",
            mfu=mfu,
        )
        cfg = self.config
        self.summary = render_profile(fig, cfg.profile_step, cfg.module_depth, cfg.top_modules, cfg.detailed, context)
        if writes:
            text = "\n".join(self.summary)
            self._print(text)
            if cfg.output_file:
                try:
                    path = Path(cfg.output_file)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text + "\n")
                except OSError as error:  # an observer must not stop training on one rank ([Note: events are …])
                    logger.warning("flops_profiler.output_file %s could not be written: %s", cfg.output_file, error)


def attach_flops_profiler(engine: Any) -> EngineFlopsProfiler:
    """Build ``engine.flops_profiler`` and subscribe it to ``engine.events`` (call once ``engine.progress`` exists)."""
    config = engine.config
    owner = weakref.ref(engine)  # no cycle through the listener: dropping the engine frees it
    profiler = EngineFlopsProfiler(
        config.flops_profiler,
        engine.module,
        topology=engine.topology,
        collectives=engine.collectives,
        device=engine.device,
        compute_dtype=config.compute_dtype,
        steps_done=lambda: owner().progress.global_steps,
        micro_batch_size=config.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        param_specs=getattr(engine, "param_specs", None),
    )
    engine.events.subscribe(profiler)
    return profiler
