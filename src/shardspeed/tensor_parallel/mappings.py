"""The communication of tensor-parallel layers, as autograd Functions (Megatron's mappings).

Each function is the identity on a tensor axis of one rank. The names follow Megatron-LM
(``megatron/core/tensor_parallel/mappings.py``); in the Megatron paper's notation, ``f`` is the operator in front of
a column-parallel layer (identity forward, all-reduce backward) and ``g`` the one after a row-parallel layer
(all-reduce forward, identity backward) — they are conjugates: each one's forward is the other's backward.

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022) replaces each ``g`` by a reduce-scatter along the
sequence dim and each ``f`` by an all-gather along it (``ḡ`` and ``f̄`` in that paper): same bytes on the wire as
the all-reduce they replace (an all-reduce is a reduce-scatter plus an all-gather), but the activations between
tensor-parallel regions (layer norms, dropout, residuals) are held split along the sequence.

Every collective goes through ``tp.collectives`` (the engine's once bound: logged, interruptible) with a tag naming
the operator, so the comms log counts tensor-parallel traffic per operator.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.params.spec import shard_bounds
from shardspeed.tensor_parallel.context import TensorParallel

__all__ = [
    "copy_to_tensor_region",
    "gather_from_sequence_region",
    "gather_from_tensor_region",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_region",
]


# --- the primitives (no autograd) ----------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, tp: TensorParallel, tag: str) -> torch.Tensor:
    if tp.size == 1:
        return x
    out = x.contiguous().clone()  # never reduce in place: autograd may still need x
    tp.collectives.all_reduce(out, tp.axis, tag=tag)
    return out


def _check_divisible(x: torch.Tensor, dim: int, tp: TensorParallel, what: str) -> None:
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"{what}: dim {dim} of a tensor of shape {tuple(x.shape)} is not divisible by the tensor-parallel size "
            f"{tp.size}"
        )


def _split(x: torch.Tensor, dim: int, tp: TensorParallel, what: str) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication)."""
    if tp.size == 1:
        return x
    _check_divisible(x, dim, tp, what)
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


def _gather(x: torch.Tensor, dim: int, tp: TensorParallel, tag: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all-gather)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((tp.size, *x.shape), dtype=x.dtype, device=x.device)
    tp.collectives.all_gather(out.view(-1), x.view(-1), tp.axis, tag=tag)  # flat: gloo wants equal shapes
    return torch.cat(out.unbind(0), dim=dim)


def _split_uneven(x: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's ceil-chunk of ``x`` along ``dim`` (``shard_bounds``: the last rank may hold less, or nothing),
    the same split the layers' parameter specs use, so any feature count works."""
    if tp.size == 1:
        return x
    start, end = shard_bounds(x.shape[dim], tp.size, tp.rank)
    return x.narrow(dim, start, end - start).contiguous()


def _gather_uneven(x: torch.Tensor, dim: int, full: int, tp: TensorParallel, tag: str) -> torch.Tensor:
    """Inverse of ``_split_uneven``: every rank's ceil-chunk of a dim of length ``full`` concatenated along
    ``dim``. The all-gather moves equal chunks (gloo has no uneven all-gather), so short chunks are padded to
    ``ceil(full / size)`` first and the padding is dropped after; the log counts the padded message."""
    if tp.size == 1:
        return x
    chunk = shard_bounds(full, tp.size, 0)[1]
    start, end = shard_bounds(full, tp.size, tp.rank)
    if x.shape[dim] != end - start:
        raise ValueError(
            f"'{tag}': this rank holds {x.shape[dim]} along dim {dim}, but a dim of {full} split {tp.size} ways "
            f"gives tensor rank {tp.rank} {end - start}"
        )
    if chunk * tp.size == full:  # even split: a plain all-gather
        return _gather(x, dim, tp, tag)
    pad_shape = list(x.shape)
    pad_shape[dim] = chunk - (end - start)
    gathered = _gather(torch.cat([x, x.new_zeros(pad_shape)], dim=dim), dim, tp, tag)
    lengths = [b - a for a, b in (shard_bounds(full, tp.size, r) for r in range(tp.size))]
    return torch.cat([gathered.narrow(dim, r * chunk, n) for r, n in enumerate(lengths)], dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, tp: TensorParallel, tag: str) -> torch.Tensor:
    """Sum ``x`` over the tensor axis and keep this rank's chunk along ``dim``."""
    if tp.size == 1:
        return x
    _check_divisible(x, dim, tp, f"reduce-scatter '{tag}'")
    stacked = torch.stack(x.chunk(tp.size, dim=dim)).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    tp.collectives.reduce_scatter(out.view(-1), stacked.view(-1), tp.axis, tag=tag)
    return out


# --- autograd Functions ---------------------------------------------------------------------------------------------
class _CopyToTensorRegion(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.tp, "tp.f.backward"), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return _all_reduce(x, tp, "tp.g.forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp, ctx.full = tp, x.shape[-1]
        return _split_uneven(x, -1, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_uneven(grad, -1, ctx.full, ctx.tp, "tp.scatter.backward"), None


class _GatherFromTensorRegion(torch.autograd.Function):
    """All-gather along the last dim forward (``gather_output``); keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, full: int) -> torch.Tensor:
        ctx.tp = tp
        return _gather_uneven(x, -1, full, tp, "tp.gather.forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split_uneven(grad, -1, ctx.tp), None, None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Enter a sequence-parallel region: keep this rank's chunk of the sequence dim; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _split(x, dim, tp, "scatter_to_sequence_region")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.tp, "sp.scatter.backward"), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """SP's ``f̄``: all-gather along the sequence dim forward; backward reduce-scatter (the gathered tensor fed a
    tensor-parallel layer, so each rank holds a partial gradient) or, with ``tensor_parallel_output_grad=False``,
    just keep this rank's chunk."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: int, tensor_parallel_output_grad: bool, tag: str
    ) -> Any:
        ctx.tp, ctx.dim, ctx.reduce, ctx.tag = tp, dim, tensor_parallel_output_grad, tag
        return _gather(x, dim, tp, f"{tag}.forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if ctx.reduce:
            return _reduce_scatter(grad, ctx.dim, ctx.tp, f"{ctx.tag}.backward"), None, None, None, None
        return _split(grad, ctx.dim, ctx.tp, "gather_from_sequence_region backward"), None, None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """SP's ``ḡ``: reduce-scatter along the sequence dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _reduce_scatter(x, dim, tp, "sp.g.forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.tp, "sp.g.backward"), None, None


# --- the public functions -------------------------------------------------------------------------------------------
def copy_to_tensor_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``f``: enter a tensor-parallel region with a replicated input."""
    return x if tp.size == 1 else _CopyToTensorRegion.apply(x, tp)


def reduce_from_tensor_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``g``: leave a tensor-parallel region by summing the ranks' partial outputs."""
    return x if tp.size == 1 else _ReduceFromTensorRegion.apply(x, tp)


def scatter_to_tensor_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Split the last dim over the tensor axis (a row-parallel layer's input that is not yet split), in ceil chunks
    (``shard_bounds``), so it matches a row-parallel weight split the same way."""
    return x if tp.size == 1 else _ScatterToTensorRegion.apply(x, tp)


def gather_from_tensor_region(x: torch.Tensor, tp: TensorParallel, full: int | None = None) -> torch.Tensor:
    """Concatenate the ranks' last-dim slices (a column-parallel layer with ``gather_output``). ``full``: the
    gathered length when the slices are ceil chunks of a dim not divisible by the tensor size (default: equal
    slices, ``size ×`` this rank's)."""
    if tp.size == 1:
        return x
    return _GatherFromTensorRegion.apply(x, tp, full if full is not None else x.shape[-1] * tp.size)


def scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallel, dim: int = 1) -> torch.Tensor:
    """Split the sequence dim (``dim``; 1 for batch-first ``[b, s, h]``) to enter a sequence-parallel region."""
    return x if tp.size == 1 else _ScatterToSequenceRegion.apply(x, tp, dim)


def gather_from_sequence_region(
    x: torch.Tensor,
    tp: TensorParallel,
    dim: int = 1,
    *,
    tensor_parallel_output_grad: bool = True,
    tag: str = "sp.f",
) -> torch.Tensor:
    """``f̄``: all-gather the sequence dim (before a column-parallel layer under sequence parallelism).
    ``tag``: the comms-log tag stem (``.forward`` / ``.backward`` appended); the model's exit from the region uses
    its own (``sp.leave``), so a block's traffic can be told from the model's."""
    return x if tp.size == 1 else _GatherFromSequenceRegion.apply(x, tp, dim, tensor_parallel_output_grad, tag)


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallel, dim: int = 1) -> torch.Tensor:
    """``ḡ``: sum partial outputs and split the sequence dim (after a row-parallel layer under sequence
    parallelism)."""
    return x if tp.size == 1 else _ReduceScatterToSequenceRegion.apply(x, tp, dim)
