"""The non-native algorithms of [Note: collective algorithms] (comm/algorithms.py): each launches torch calls
asynchronously and returns their handles plus the action that completes the logical op once they have landed.
``Collectives`` wraps them in one ``CompositeWork`` (waited through the failure board like every wait)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardspeed.topology import AxisGroup

# torch's names for the single-tensor collectives (newer torch renamed them; the old names warn)
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Launched:
    """Handles of one logical op, the action run after every handle is waited, and tensors to keep alive."""

    handles: list[dist.Work]
    finish: Callable[[], None] | None
    keep: tuple[torch.Tensor, ...]


def reduce_scatter_by_all_reduce(
    shard: torch.Tensor, unsharded: torch.Tensor, axis: AxisGroup, clobber_input: bool
) -> Launched:
    """Sum the whole input over ``axis`` (in place if the caller allows it, else a scratch copy), then copy this
    rank's slice into ``shard``: the same numbers as gloo's reduce-scatter, which sums as an all-reduce does."""
    full = unsharded if clobber_input else unsharded.clone(memory_format=torch.contiguous_format)
    handle = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
    n = shard.numel()
    mine = full.reshape(-1)[axis.rank * n : (axis.rank + 1) * n]

    def finish() -> None:
        if mine.data_ptr() != shard.data_ptr():  # an in-place shard (its slot of a clobbered input) is already there
            shard.copy_(mine.view(shard.shape))

    return Launched([handle], finish, (full,))


def in_slot(shard: torch.Tensor, unsharded: torch.Tensor, axis: AxisGroup) -> bool:
    """Whether ``shard`` is this rank's own slot of ``unsharded`` (an in-place collective)."""
    n = shard.numel()
    return (
        shard.is_contiguous()
        and unsharded.is_contiguous()
        and shard.data_ptr() == unsharded.data_ptr() + axis.rank * n * unsharded.element_size()
    )


def reduce_scatter_into_slot(shard: torch.Tensor, unsharded: torch.Tensor, axis: AxisGroup) -> Launched:
    """A native reduce-scatter whose output is its own input's slot: a separate output, copied into the slot when it
    lands (an output aliasing the input is not portable across backends)."""
    out = torch.empty_like(shard)
    handle = REDUCE_SCATTER_SINGLE(out, unsharded, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
    return Launched([handle], lambda: shard.copy_(out), (out, unsharded))


def all_gather_by_broadcast(unsharded: torch.Tensor, shard: torch.Tensor, axis: AxisGroup) -> Launched:
    """Each owner's shard broadcast from its owner into its slice of the output: the owner first copies its shard
    into place (skipped when it already is the slice), then N async broadcasts, launched in axis order on every
    rank (``unsharded`` is contiguous: the caller falls back to native otherwise)."""
    out, n = unsharded.view(-1), shard.numel()
    mine = out[axis.rank * n : (axis.rank + 1) * n]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard.reshape(-1))
    handles = [
        dist.broadcast(out[i * n : (i + 1) * n], src=src, group=axis.group, async_op=True)
        for i, src in enumerate(axis.ranks)
    ]
    return Launched(handles, None, (unsharded, shard))


def all_gather_from_copy(unsharded: torch.Tensor, shard: torch.Tensor, axis: AxisGroup) -> Launched:
    """A native all-gather of an in-place shard from a copy of it (kept alive until the gather lands)."""
    copy = shard.clone()
    handle = ALL_GATHER_SINGLE(unsharded, copy, group=axis.group, async_op=True)
    return Launched([handle], None, (copy, unsharded))
