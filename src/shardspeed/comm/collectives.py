"""Typed collectives over one mesh axis. Every call names its AxisGroup; a size-1 axis is a no-op.

This is the only module that calls torch.distributed collectives, so backend quirks live here:
- gloo has no PREMUL_SUM and no uneven all_gather: callers scale before/after and pad to equal shards.
- torch >= 2.13 prefers all_gather_single / reduce_scatter_single; older releases only have the *_tensor names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm.log import CommsLog
from shardspeed.comm.order_check import OrderChecker
from shardspeed.topology import AxisGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Work:
    """A pending collective (or an already-finished no-op). ``wait()`` is idempotent."""

    def __init__(self, handle: dist.Work | None) -> None:
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (the collective has finished)."""
        return self._handle is None or self._handle.is_completed()


class Collectives:
    """Collectives with an attached comms log. One per engine; passed down explicitly."""

    def __init__(self, log: CommsLog | None = None, *, verify_order: bool = False) -> None:
        self.log = log or CommsLog(enabled=False)
        # [Note: collective-order verification] in comm/order_check.py: None (the default) costs one attribute
        # check per collective. Every rank must pass the same flag (engine_setup.engine_collectives agrees it).
        self.order: OrderChecker | None = OrderChecker(_exchange_digest, _exchange_object) if verify_order else None

    def all_reduce(self, tensor: torch.Tensor, axis: AxisGroup, *, async_op: bool = False, tag: str = "") -> Work:
        """Sum ``tensor`` in place over ``axis``."""
        if self.order is not None:
            self.order.check("all_reduce(sum)", axis, (tensor,), tag)
        if axis.size == 1:
            return Work(None)
        self.log.record("all_reduce", tensor.numel(), tensor.element_size(), axis.size, tag)
        return Work(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=axis.group, async_op=async_op))

    def all_reduce_max(self, tensor: torch.Tensor, axis: AxisGroup, *, tag: str = "") -> None:
        if self.order is not None:
            self.order.check("all_reduce(max)", axis, (tensor,), tag)
        if axis.size == 1:
            return
        self.log.record("all_reduce", tensor.numel(), tensor.element_size(), axis.size, tag)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=axis.group)

    def all_gather(
        self,
        unsharded: torch.Tensor,
        shard: torch.Tensor,
        axis: AxisGroup,
        *,
        async_op: bool = False,
        tag: str = "",
    ) -> Work:
        """Concatenate every rank's equal-sized ``shard`` into ``unsharded`` (size = shard × axis size)."""
        if self.order is not None:
            self.order.check("all_gather", axis, (shard, unsharded), tag)
        if unsharded.numel() != shard.numel() * axis.size:
            raise ValueError(f"all_gather: output {unsharded.numel()} != shard {shard.numel()} × {axis.size}")
        if axis.size == 1:
            if unsharded.data_ptr() != shard.data_ptr():
                unsharded.copy_(shard)
            return Work(None)
        self.log.record("all_gather", unsharded.numel(), unsharded.element_size(), axis.size, tag)
        return Work(_all_gather_single(unsharded, shard, group=axis.group, async_op=async_op))

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        unsharded: torch.Tensor,
        axis: AxisGroup,
        *,
        async_op: bool = False,
        tag: str = "",
    ) -> Work:
        """Sum ``unsharded`` over ``axis`` and keep this rank's equal slice in ``shard``."""
        if self.order is not None:
            self.order.check("reduce_scatter(sum)", axis, (unsharded, shard), tag)
        if unsharded.numel() != shard.numel() * axis.size:
            raise ValueError(f"reduce_scatter: input {unsharded.numel()} != shard {shard.numel()} × {axis.size}")
        if axis.size == 1:
            if unsharded.data_ptr() != shard.data_ptr():
                shard.copy_(unsharded)
            return Work(None)
        self.log.record("reduce_scatter", unsharded.numel(), unsharded.element_size(), axis.size, tag)
        return Work(_reduce_scatter_single(shard, unsharded, op=dist.ReduceOp.SUM, group=axis.group, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, axis: AxisGroup, src_index: int = 0, *, tag: str = "") -> None:
        """Copy axis member ``src_index``'s tensor to every member (``src_index`` is an axis index, not global)."""
        if self.order is not None:
            self.order.check(f"broadcast(src={src_index})", axis, (tensor,), tag)
        if axis.size == 1:
            return
        self.log.record("broadcast", tensor.numel(), tensor.element_size(), axis.size, tag)
        dist.broadcast(tensor, src=axis.ranks[src_index], group=axis.group)

    def all_gather_object(self, obj: object, axis: AxisGroup) -> list[object]:
        """Small Python objects (validation fingerprints, RSS figures); not logged as traffic."""
        if self.order is not None:
            self.order.check("all_gather_object", axis)
        if axis.size == 1:
            return [obj]
        out: list[object] = [None] * axis.size
        dist.all_gather_object(out, obj, group=axis.group)
        return out


def _check_group(axis: AxisGroup) -> dist.ProcessGroup | None:
    """Where an order check runs: ``WORLD`` for a group of every rank, so ranks that diverged onto two such groups
    still meet in one exchange ([Note: collective-order verification])."""
    return dist.group.WORLD if axis.size == dist.get_world_size() else axis.group


def _exchange_digest(digest: int, axis: AxisGroup) -> list[int]:
    """All-gather one int64 over ``axis`` (raw: not verified, not logged)."""
    group = _check_group(axis)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(axis.size, dtype=torch.int64, device=device)
    # Through Work.wait, like every engine collective: whatever waiting does (e.g. watching for a failed peer)
    # applies to the agreement too.
    Work(_all_gather_single(everyone, mine, group=group, async_op=True)).wait()
    return everyone.tolist()


def _exchange_object(obj: object, axis: AxisGroup) -> list[object]:
    out: list[object] = [None] * axis.size
    dist.all_gather_object(out, obj, group=_check_group(axis))
    return out
