"""ZeRO stages 1 and 2: optimizer states (and for stage 2 gradients) exist only for this rank's shard.

Layout (see [Note: bucket-major sharding] in zero/layout.py): the model's parameters are repacked as views of one
flat, padded buffer; this rank owns the same 1/N slice of every bucket. What lives where, per rank:

                          fp32 training            bf16/fp16 training       bf16 master weights
  parameters (full)       4Ψ  (the flat buffer)    2Ψ                       2Ψ
  master shard            — (steps the param       4Ψ/N (fp32)              — (steps the param buffer,
                            buffer's own slices)                              as fp32 training does)
  gradients               stage 1: 4Ψ full buffer (the shard is this rank's slices of it); bf16 masters: 2Ψ
                          stage 2: 4Ψ/N shard (+ buckets in flight during backward); bf16 masters: 2Ψ/N
  optimizer states        K·Ψ/N (Adam: 8Ψ/N; bf16 masters: 4Ψ/N)

The optimizer steps one tensor per bucket slice (element-wise optimizers cannot tell the difference); after the
step every bucket is all-gathered back into the parameter buffer in one equal-split collective, launched by the step
and waited by the next forward with ``overlap_param_gather`` ([Note: overlapped parameter gather] in
zero/param_gather.py), else waited before ``step()`` returns. Transient not in the table: each pending gather's
input (this rank's slice of the bucket: the master slice cast to the compute dtype, or in fp32 / bf16 masters a
clone of the parameter buffer's own slice) — Ψ/N elements of the parameters' dtype (2Ψ/N bytes in bf16, 4Ψ/N in
fp32) — lives until the gather is waited: inside ``step()`` without the overlap, until the next forward with it.
It is kept under every algorithm, though the broadcast one has copied it into place at launch, so that what a
pending bucket holds does not depend on the algorithm. With a streamed
offload optimizer under mixed precision the master shard moves into the optimizer's store
(``hand_masters_to_optimizer``): 0 bytes here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.checkpoint.pieces import Piece
from shardspeed.offload.stepped_access import TargetSlices, stand_in
from shardspeed.precision.grad_norm import sum_of_squares
from shardspeed.precision.norm_weights import NormScope, counted_views
from shardspeed.zero.arrival_order import LayoutPlanner
from shardspeed.zero.compressed_grads import GradCompression
from shardspeed.zero.grad_buffer import FlatGradBuffer, param_views
from shardspeed.zero.grad_markers import SteppedGrads
from shardspeed.zero.grad_sync import CommContext, ReduceScatterGrads, StagedReduceScatter, StagingMeter
from shardspeed.zero.layout import ShardLayout, intersect
from shardspeed.zero.param_gather import ParamGather, launch_order
from shardspeed.zero.param_groups import PackedParams
from shardspeed.zero.reducer import GradReducer
from shardspeed.zero.relayout_state import carry_shard_states, reshard
from shardspeed.zero.relayout_streamed import relayout_streamed
from shardspeed.zero.states import FlatLayoutStates, has_nonfinite


class PartitionedStates(FlatLayoutStates):
    def __init__(
        self,
        stage: int,
        packed: PackedParams,
        planner: LayoutPlanner,
        ctx: CommContext,
        device: torch.device,
        overlap: bool,
        master_dtype: torch.dtype = torch.float32,
        *,
        module: torch.nn.Module | None = None,
        overlap_param_gather: bool = False,
    ) -> None:
        """``module``/``overlap_param_gather``: the model whose owning modules wait for their buckets' gathers in
        forward pre-hooks; without overlap (or a module) every gather is waited inside ``after_optimizer_step``."""
        assert stage in (1, 2), stage
        self.master_dtype = master_dtype  # [Note: low-precision masters]
        self.stage, self.planner, self.ctx, self.device = stage, planner, ctx, device
        self.packed = packed
        self.communicate_every_micro_step = stage == 2
        dtypes = {p.dtype for p in packed.params} or {torch.float32}
        assert len(dtypes) == 1, f"one parameter dtype expected, got {dtypes}"
        self.compute_dtype = dtypes.pop()
        self.masters_in_optimizer = False  # hand_masters_to_optimizer
        self.meter = StagingMeter()
        self.norm_scope = NormScope()
        self._segments: dict[int, list[tuple[int, int, int]]] = {}
        self.overlap_param_gather = overlap_param_gather and module is not None
        self.param_gather = ParamGather(module if self.overlap_param_gather else None, packed.params)
        self.compression: GradCompression | None = None  # 1-bit Adam's compressed phase (set_grad_compression)
        self._build(planner.build())
        self.reducer = GradReducer(packed.params, packed.names, self.layout, self.grad_sync, overlap=overlap)
        self._set_markers()

    def _set_markers(self) -> None:
        """[Note: gradient markers]: stage 1 fp32 parameters' .grad view the full buffer; otherwise sentinels."""
        buffer = self.grad_buffer
        self.reducer.markers.set_views(buffer.views if buffer is not None and buffer.as_views else None)
        storage = buffer.flat if buffer is not None else self.shard_flat
        assert storage is not None
        self._stepped = SteppedGrads(lambda: self.bucket_tensors, lambda: [storage])
        self._stepped.snapshot()

    def _stepped_grads(self) -> SteppedGrads:
        return self._stepped

    def _clears_everything_when_written(self) -> bool:
        return self.stage == 1

    def _build(self, layout: ShardLayout) -> None:
        """Every buffer that follows the layout; parameter values are copied from the parameters as they are."""
        self.layout = layout
        packed, device, rank = self.packed, self.device, self.ctx.axis.rank
        self.param_gather.bind(
            [layout.span(i) for i in range(len(packed.params))], [(b.start, b.end) for b in layout.buckets]
        )
        mixed = self.compute_dtype != self.master_dtype  # a separate master shard only then
        # Parameters become views of one padded flat buffer (the all-gather destination).
        self.param_flat = torch.zeros(layout.total, dtype=self.compute_dtype, device=device)
        with torch.no_grad():
            for p, view in zip(packed.params, param_views(self.param_flat, layout, packed.params)):
                view.copy_(p)
                p.data = view
        self.master_shard: torch.Tensor | None = None
        if mixed:
            self.master_shard = torch.empty(layout.shard_numel, dtype=self.master_dtype, device=device)
        self.grad_buffer: FlatGradBuffer | None = None
        self.shard_flat: torch.Tensor | None = None
        if self.stage == 1:
            self.grad_buffer = FlatGradBuffer(
                packed.params, layout, self.master_dtype, as_views=not mixed, device=device
            )
            self.grad_shards = [
                self.grad_buffer.flat.narrow(0, *_start_len(layout.rank_slice(k, rank)))
                for k in range(len(layout.buckets))
            ]
        else:
            self.shard_flat = torch.zeros(layout.shard_numel, dtype=self.master_dtype, device=device)
            self.grad_shards = [
                self.shard_flat.narrow(0, *_start_len(layout.shard_offset(k))) for k in range(len(layout.buckets))
            ]
        # One optimizer tensor per bucket: the bucket's slice of the master shard (mixed) or of the parameter
        # buffer itself (fp32: no separate master copy), with this rank's reduced gradient slice as its .grad.
        self.bucket_tensors: list[torch.Tensor] = []
        self.group_tensors: dict[int, list[torch.Tensor]] = {}
        for k, bucket in enumerate(layout.buckets):
            lo, hi = layout.shard_offset(k)
            start, end = layout.rank_slice(k, rank)
            if self.master_shard is not None:
                tensor = self.master_shard[lo:hi]
                tensor.copy_(self.param_flat[start:end])
            else:
                tensor = self.param_flat[start:end]
            tensor.grad = self.grad_shards[k]
            self.bucket_tensors.append(tensor)
            self.group_tensors.setdefault(bucket.group, []).append(tensor)
        if self.grad_buffer is not None:
            self.grad_sync: ReduceScatterGrads | StagedReduceScatter = ReduceScatterGrads(
                self.grad_buffer, self.grad_shards, self.ctx, self.meter
            )
        else:
            assert self.shard_flat is not None
            self.grad_sync = StagedReduceScatter(
                packed.params, layout, self.shard_flat, self.grad_shards, self.ctx, self.meter
            )
        self._bind_compression()

    def set_grad_compression(self, compression: GradCompression) -> None:
        """[Note: compressed ZeRO gradients]: each bucket's reduce-scatter goes through ``compression`` while it
        is active (1-bit Adam after ``freeze_step``)."""
        self.compression = compression
        self._bind_compression()

    def _bind_compression(self) -> None:
        self.grad_sync.compression = self.compression
        if self.compression is not None:
            self.compression.bind(self.layout)

    @torch.no_grad()
    def _relayout(self, layout: ShardLayout, optimizer: torch.optim.Optimizer) -> None:
        """Before this run's first reduction: move parameter values (by ``_build``), what earlier micro-steps
        accumulated, the fp32 master shard and the optimizer's states (zero/relayout_state.py; collective)."""
        assert not self.masters_in_optimizer
        old_layout, old_tensors, old_master = self.layout, self.bucket_tensors, self.master_shard
        old_buffer, old_sync = self.grad_buffer, self.grad_sync
        carry_masters = old_master is not None and self._masters_differ_from_params()
        self._build(layout)  # masters re-copied from the parameters: all a fresh run needs (no gather)
        rank = self.ctx.axis.rank
        if carry_masters:  # a loaded checkpoint's fp32 values, finer than the parameters
            assert old_master is not None and self.master_shard is not None
            self.master_shard.copy_(reshard(old_master, old_layout, layout, rank, self._gather))
        carry_shard_states(optimizer, old_tensors, self.bucket_tensors, old_layout, layout, rank, self._gather)
        self.tensor_segments()  # refreshed in place for sharded Lamb
        if old_buffer is not None:
            assert self.grad_buffer is not None
            for new_view, old_view in zip(self.grad_buffer.views, old_buffer.views):
                new_view.copy_(old_view)
        else:
            assert isinstance(old_sync, StagedReduceScatter) and isinstance(self.grad_sync, StagedReduceScatter)
            assert old_sync.shard_flat.count_nonzero() == 0, "stage 2 re-layout after a reduction"
            self.grad_sync.adopt(old_sync)
        self.reducer.set_layout(layout, self.grad_sync)
        self._set_markers()

    def _relayout_streamed(self, layout: ShardLayout, optimizer: Any, groups: list[dict[str, Any]]) -> None:
        relayout_streamed(self, layout, optimizer, groups)

    def _masters_differ_from_params(self) -> bool:
        """Whether any rank's fp32 master shard holds more than its low-precision parameters (one scalar
        all-reduce, so every rank takes the same, collective, branch)."""
        assert self.master_shard is not None
        rank, differ = self.ctx.axis.rank, False
        for k, tensor in enumerate(self.bucket_tensors):
            params = self.param_flat[slice(*self.layout.rank_slice(k, rank))]
            differ = differ or not torch.equal(tensor, params.to(self.master_dtype))
        flag = torch.tensor([float(differ)], device=self.master_shard.device)
        self.ctx.collectives.all_reduce_max(flag, self.ctx.axis, tag="relayout")
        return flag.item() > 0

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        out = torch.empty(shard.numel() * self.ctx.axis.size, dtype=shard.dtype, device=shard.device)
        self.ctx.collectives.all_gather(out, shard, self.ctx.axis, tag="relayout")
        return out

    def hand_masters_to_optimizer(self) -> TargetSlices | None:
        """Mixed precision with a streamed offload optimizer (which keeps fp32 values in its store): drop the
        master shard; each bucket's stepped tensor becomes a stand-in whose values are reached, through the
        returned access, as its low-precision parameter slice. Call before the optimizer is built."""
        if self.master_shard is None:
            return None
        access, rank, replaced = TargetSlices(), self.ctx.axis.rank, {}
        for k, tensor in enumerate(self.bucket_tensors):
            new = stand_in(tensor.numel(), tensor)
            new.grad = tensor.grad
            access.add(new, self.param_flat[slice(*self.layout.rank_slice(k, rank))])
            replaced[id(tensor)] = new
        self.bucket_tensors = [replaced[id(t)] for t in self.bucket_tensors]
        self.group_tensors = {g: [replaced[id(t)] for t in ts] for g, ts in self.group_tensors.items()}
        self.master_shard, self.masters_in_optimizer = None, True
        return access

    def set_final_grads_hook(self, hook: Callable[[list[torch.Tensor]], None]) -> None:
        """``hook(stepped tensors)`` as each bucket's reduced gradient of a step is final (offload's host copy)."""
        self.reducer.on_final = lambda k: hook([self.bucket_tensors[k]])

    @property
    def managed_names(self) -> set[str]:
        """Parameters whose values and optimizer states this stage holds (the rest are saved whole)."""
        return set(self.packed.names)

    def checkpoint_pieces(self) -> list[Piece]:
        """This rank's slice of every bucket, cut at parameter boundaries (each rank writes what it owns)."""
        pieces = []
        rank = self.ctx.axis.rank
        # the stepped tensor's own slice when it holds the fp32 values (or stands in for them: the optimizer's
        # resident_pieces swaps them in); fp32 training steps the parameter buffer itself
        stepped = self.master_shard is not None or self.masters_in_optimizer
        for k, tensor in enumerate(self.bucket_tensors):
            start, end = self.layout.rank_slice(k, rank)
            for i in self.layout.buckets[k].members:
                lo, hi = self.layout.span(i)
                owned = intersect((lo, hi), (start, end))
                if owned is None:
                    continue
                view = tensor[owned[0] - start : owned[1] - start] if stepped else self.param_flat[owned[0] : owned[1]]
                p = self.packed.params[i]
                shape = tuple(p.shape)
                pieces.append(
                    Piece(
                        self.packed.names[i], shape, owned[0] - lo, owned[1] - lo, view, tensor, owned[0] - start, True
                    )
                )
        return pieces

    def tensor_segments(self) -> dict[int, list[tuple[int, int, int]]]:
        """For each optimizer tensor (by id): the (parameter index, start, end) of every parameter piece in it.
        Always the same dict, refreshed in place by a re-layout: ZeRO-sharded Lamb keeps it."""
        rank = self.ctx.axis.rank
        out = self._segments
        out.clear()
        for k, tensor in enumerate(self.bucket_tensors):
            start, end = self.layout.rank_slice(k, rank)
            pieces = []
            for i in self.layout.buckets[k].members:
                owned = intersect(self.layout.span(i), (start, end))
                if owned:
                    pieces.append((i, owned[0] - start, owned[1] - start))
            out[id(tensor)] = pieces
        return out

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**g, "params": self.group_tensors.get(i, [])} for i, g in enumerate(groups)]

    @property
    def peak_bucket_bytes(self) -> int:
        """Staging peak (see [Note: staging memory] in zero/grad_sync.py)."""
        return self.meter.peak

    def bind_norm(self, scope: NormScope) -> None:
        self.norm_scope = scope

    def grad_sq_sum(self) -> float:
        """This rank's slices, replicated parameters left out off tensor rank 0; one all-reduce over the data
        axis, or the world with a tensor/pipe axis ([Note: norm counted once])."""
        scope, rank = self.norm_scope, self.ctx.axis.rank
        spans = [self.layout.span(i) for i, n in enumerate(self.packed.names) if n in scope.excluded]
        windows = [self.layout.rank_slice(k, rank) for k in range(len(self.layout.buckets))]
        partial = sum_of_squares(counted_views(self.grad_shards, windows, spans), self.device)
        self.ctx.collectives.all_reduce(partial, scope.sharded_grads or self.ctx.axis, tag="grad_norm")
        return partial.item()

    def nonfinite_grad_names(self) -> list[str]:
        """This rank's slice of every bucket (stage 1's full buffer holds unreduced values elsewhere)."""
        rank, names = self.ctx.axis.rank, []
        for k, shard in enumerate(self.grad_shards):
            start, end = self.layout.rank_slice(k, rank)
            for i in self.layout.buckets[k].members:
                owned = intersect(self.layout.span(i), (start, end))
                if owned is not None and has_nonfinite(shard[owned[0] - start : owned[1] - start]):
                    names.append(self.packed.names[i])
        return names

    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_(self.grad_shards, factor)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """All-gather every bucket's updated shards into the parameter buffer, last bucket first. With
        ``overlap_param_gather`` only launched: the next forward waits per bucket, every other reader through
        ``wait_params`` ([Note: overlapped parameter gather]); otherwise waited here."""
        self.wait_params()  # a gather still pending into this buffer (a second push without a forward)
        rank, gather = self.ctx.axis.rank, self.param_gather
        for k in launch_order(len(self.layout.buckets)):
            bucket = self.layout.buckets[k]
            lo, hi = self.layout.shard_offset(k)
            if self.master_shard is not None:
                shard = self.master_shard[lo:hi].to(self.compute_dtype)  # a temporary: kept until the gather lands
            else:
                start, end = self.layout.rank_slice(k, rank)
                shard = self.param_flat[start:end]  # in place: Collectives copies it where a backend needs that
            out = self.param_flat[bucket.start : bucket.end]
            work = self.ctx.collectives.all_gather(out, shard, self.ctx.axis, async_op=True, tag="params")
            gather.launch(k, work, shard)
        if not self.overlap_param_gather:
            gather.wait_all()

    def wait_params(self) -> None:
        """Block until every pending parameter gather of the last step has landed (idempotent, cheap when none)."""
        self.param_gather.wait_all()

    @property
    def pending_gathers(self) -> int:
        """Buckets whose parameter gather was launched and not yet waited."""
        return self.param_gather.pending

    def close(self) -> None:
        """``engine.destroy()``: land pending gathers, then remove the forward hooks (even if a peer failed)."""
        try:
            self.wait_params()
        finally:
            self.param_gather.remove_hooks()

    def zero_grads(self) -> None:
        self.reducer.zero()

    def _held_view(self, index: int) -> torch.Tensor:
        """[Note: step-scoped hold] in zero/hold.py: stage 1's full buffer, stage 2's held bucket buffer."""
        if self.grad_buffer is not None:
            return self.grad_buffer.views[index]
        assert isinstance(self.grad_sync, StagedReduceScatter)
        return self.grad_sync.held_segment(index)

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"params": self.param_flat}
        if self.grad_buffer is not None:
            out["grads"] = self.grad_buffer.flat
        if self.shard_flat is not None:
            out["grad_shard"] = self.shard_flat
            assert isinstance(self.grad_sync, StagedReduceScatter)
            out["grad_hold"] = self.grad_sync.held_buffers()  # type: ignore[assignment]  # during a held step
        if self.master_shard is not None:
            out["master_shard"] = self.master_shard
        return out


def _start_len(span: tuple[int, int]) -> tuple[int, int]:
    return span[0], span[1] - span[0]
