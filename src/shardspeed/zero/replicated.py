"""Stage 0 model states: full gradients all-reduced in buckets; masters (fp32) when the parameters' dtype differs
from the master dtype (bf16/fp16 training; none with bf16 master weights: [Note: low-precision masters])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.checkpoint.pieces import Piece
from shardspeed.compression.engine_wiring import OptimizerOwnedGrads
from shardspeed.precision.grad_norm import sum_of_squares
from shardspeed.precision.master import MasterWeights
from shardspeed.precision.norm_weights import NormScope, counted_views
from shardspeed.zero.arrival_order import LayoutPlanner
from shardspeed.zero.grad_buffer import FlatGradBuffer
from shardspeed.zero.grad_markers import SteppedGrads
from shardspeed.zero.grad_sync import AllReduceGrads, CommContext, StagingMeter
from shardspeed.zero.layout import ShardLayout
from shardspeed.zero.param_groups import PackedParams
from shardspeed.zero.reducer import GradReducer
from shardspeed.zero.relayout_state import carry_param_states
from shardspeed.zero.states import FlatLayoutStates, has_nonfinite


class ReplicatedStates(FlatLayoutStates):
    communicate_every_micro_step = False

    def __init__(
        self,
        packed: PackedParams,
        planner: LayoutPlanner,
        ctx: CommContext,
        device: torch.device,
        overlap: bool,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.master_dtype = master_dtype
        self.mixed = any(p.dtype != master_dtype for p in packed.params)
        self.packed, self.planner, self.ctx, self.device = packed, planner, ctx, device
        self.rank, self.world = ctx.axis.rank, ctx.axis.size
        self.meter = StagingMeter()
        self.norm_scope = NormScope()
        self._segments: dict[int, list[tuple[int, int, int]]] = {}
        self.optimizer_owns: Callable[[], bool] | None = None  # [Note: optimizer-owned communication]
        self._build(planner.build())
        self.reducer = GradReducer(packed.params, packed.names, self.layout, self.grad_sync, overlap=overlap)
        self._set_markers()

    def _set_markers(self) -> None:
        """[Note: gradient markers]: fp32 parameters' .grad view the buffer; mixed ones hold sentinels."""
        self.reducer.markers.set_views(None if self.mixed else self.grad_buffer.views)
        self._stepped = SteppedGrads(
            lambda: self.master.masters if self.master is not None else [], lambda: [self.grad_buffer.flat]
        )
        self._stepped.snapshot()

    def _stepped_grads(self) -> SteppedGrads:
        return self._stepped

    def _build(self, layout: ShardLayout) -> None:
        self.layout = layout
        self.grad_buffer = FlatGradBuffer(
            self.packed.params, layout, self.master_dtype, as_views=not self.mixed, device=self.device
        )
        self.grad_sync: Any = AllReduceGrads(self.grad_buffer, self.ctx, self.meter)
        if self.optimizer_owns is not None:  # a 1-bit optimizer: no gradient all-reduce once it communicates
            self.grad_sync = OptimizerOwnedGrads(self.grad_sync, self.optimizer_owns)
        # masters copy the model's parameters, which stage 0 never repacks: a re-layout only moves them
        self.master = MasterWeights(self.packed.params, self.grad_buffer) if self.mixed else None
        self.tensor_segments()  # refreshed in place: a Lamb over tensor-parallel slices keeps it

    @torch.no_grad()
    def _relayout(self, layout: ShardLayout, optimizer: torch.optim.Optimizer) -> None:
        old, old_master = self.grad_buffer, self.master
        self._build(layout)
        for new_view, old_view in zip(self.grad_buffer.views, old.views):  # gradients of earlier micro-steps
            new_view.copy_(old_view)
        if old_master is not None:  # fp32 values (a loaded checkpoint's may differ from the parameters)
            assert self.master is not None
            for new_master, old_one in zip(self.master.masters, old_master.masters):
                new_master.copy_(old_one)
            carry_param_states(optimizer, list(zip(old_master.masters, self.master.masters)))
        self.reducer.set_layout(layout, self.grad_sync)
        self._set_markers()

    def let_optimizer_communicate(self, owns: Callable[[], bool]) -> None:
        """While ``owns()``, backward reduces nothing ([Note: optimizer-owned communication] in
        compression/optim_base.py); called once, at construction."""
        self.optimizer_owns = owns
        self.grad_sync = OptimizerOwnedGrads(self.grad_sync, owns)
        self.reducer.set_layout(self.layout, self.grad_sync)

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.master is None:
            return groups
        swap = self.master.master_of
        return [{**g, "params": [swap.get(id(p), p) for p in g["params"]]} for g in groups]

    @property
    def peak_bucket_bytes(self) -> int:
        """Staging peak: 0 with fp32 communication (the persistent buffer is all-reduced in place)."""
        return self.meter.peak

    @property
    def managed_names(self) -> set[str]:
        """Parameters whose values and optimizer states this stage holds (the rest are saved whole)."""
        return set(self.packed.names)

    def checkpoint_pieces(self) -> list[Piece]:
        """Whole parameters on every rank; parameter i is written by rank i mod N to spread the writing."""
        pieces = []
        for i, (p, name) in enumerate(zip(self.packed.params, self.packed.names)):
            # the optimizer's state is keyed by the tensor it steps: the master, or the Parameter object itself
            stepped = self.master.masters[i] if self.master is not None else p
            value = stepped.detach().view(-1)
            pieces.append(Piece(name, tuple(p.shape), 0, p.numel(), value, stepped, 0, i % self.world == self.rank))
        return pieces

    def tensor_segments(self) -> dict[int, list[tuple[int, int, int]]]:
        """Each optimizer tensor (master or parameter) is one whole parameter (Lamb with a tensor axis)."""
        out = self._segments
        out.clear()
        for i, p in enumerate(self.packed.params):
            stepped = self.master.masters[i] if self.master is not None else p
            out[id(stepped)] = [(i, 0, p.numel())]
        return out

    def bind_norm(self, scope: NormScope) -> None:
        self.norm_scope = scope

    def grad_sq_sum(self) -> float:
        # Reduced gradients are identical on every data-parallel rank, so the norm (and any overflow) is too: no
        # collective unless the model is split over a tensor/pipe axis ([Note: norm counted once]).
        scope, partial = self.norm_scope, self._counted_sq_sum()
        if self.optimizer_owns is not None and self.optimizer_owns():
            # local gradients differ between ranks: the norm is the ranks' RMS, agreed ([Note: agreed step])
            self.ctx.collectives.all_reduce(partial, self.ctx.axis, tag="grad_norm")
            partial.div_(self.ctx.axis.size)
        if scope.whole_grads is not None:
            self.ctx.collectives.all_reduce(partial, scope.whole_grads, tag="grad_norm")
        return partial.item()

    def local_grad_sq_sum(self) -> float:
        """This rank's share of ``grad_sq_sum`` before any collective: while an optimizer owns communication
        (only stage 0 lets one), the step core agrees its finiteness in the step checks ([Note: agreed step] in
        training/step_core.py)."""
        return self._counted_sq_sum().item()

    def _counted_sq_sum(self) -> torch.Tensor:
        flat = self.grad_buffer.flat
        spans = [self.layout.span(i) for i, n in enumerate(self.packed.names) if n in self.norm_scope.excluded]
        return sum_of_squares(counted_views([flat], [(0, flat.numel())], spans), flat.device)

    def nonfinite_grad_names(self) -> list[str]:
        return [name for name, view in zip(self.packed.names, self.grad_buffer.views) if has_nonfinite(view)]

    def scale_grads(self, factor: float) -> None:
        self.grad_buffer.flat.mul_(factor)

    def after_optimizer_step(self) -> None:
        if self.master is not None:
            self.master.copy_to_model()

    def zero_grads(self) -> None:
        self.reducer.zero()

    def _held_view(self, index: int) -> torch.Tensor:
        return self.grad_buffer.views[index]  # [Note: step-scoped hold]: the flat buffer accumulates

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"grads": self.grad_buffer.flat}
        if self.master is not None:
            out["master"] = self.master.flat
        return out
