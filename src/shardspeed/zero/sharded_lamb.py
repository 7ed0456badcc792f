"""LAMB over ZeRO shards: the per-parameter norms of the trust ratio are summed across shards.

A bucket shard holds pieces of several parameters (and maybe padding). Each rank computes the element-wise part of
the update on its pieces, adds the squares of each piece into a per-parameter table (two rows: ||w||², ||r||²),
and one all-reduce of that small table gives every rank the whole-parameter norms. Each piece is then scaled by
its own parameter's trust ratio — exactly what unsharded LAMB computes.

With a tensor axis the trust ratio is that of the *global* parameter: a TP-partitioned parameter's table entries
are summed over the tensor axis as well, while a tensor-replicated one (held whole and identically by every tensor
rank) is entered on tensor rank 0 only (``weights``: 0 elsewhere), so the same sum leaves it as it is — one
all-reduce for all of them ([Note: norm counted once] in precision/norm_weights.py). At stage 0 under tensor
parallelism each optimizer tensor is one whole local parameter, and only the tensor axis is summed over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.optim.lamb import Lamb, trust_ratio
from shardspeed.topology import AxisGroup, Topology

# (parameter index, start, end) of each parameter's piece inside one optimizer tensor
Segments = list[tuple[int, int, int]]


class ShardedLamb(Lamb):
    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        segments: dict[int, Segments],
        num_params: int,
        all_reduce_sum: Callable[[torch.Tensor], None],
        weights: Sequence[float] | None = None,
        **defaults: Any,
    ) -> None:
        """``weights``: per parameter index, 1.0 where this rank's pieces count in the global norms, 0.0 where
        another tensor rank enters them (tensor-replicated parameters off tensor rank 0); None: all count."""
        super().__init__(param_groups, **defaults)
        self._segments = segments
        self._num_params = num_params
        self._all_reduce_sum = all_reduce_sum
        if weights is not None and len(weights) != num_params:
            raise ValueError(f"ShardedLamb: {len(weights)} weights for {num_params} parameters")
        self._weights = None if weights is None or all(w == 1.0 for w in weights) else list(weights)

    @classmethod
    def replacing(
        cls,
        lamb: Lamb,
        segments: dict[int, Segments],
        num_params: int,
        all_reduce_sum: Callable[[torch.Tensor], None],
        weights: Sequence[float] | None = None,
    ) -> ShardedLamb:
        """A ShardedLamb with ``lamb``'s groups and hyperparameters (its state must be empty)."""
        if lamb.state:
            raise ValueError("pass a fresh Lamb optimizer: it already has state")
        return cls(
            [dict(g) for g in lamb.param_groups],
            segments=segments,
            num_params=num_params,
            all_reduce_sum=all_reduce_sum,
            weights=weights,
            **lamb.defaults,
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pieces = []
        device = self.param_groups[0]["params"][0].device if self.param_groups[0]["params"] else None
        norms_sq = torch.zeros(2, self._num_params, dtype=torch.float32, device=device)
        for group in self.param_groups:
            for tensor in group["params"]:
                if tensor.grad is None:
                    continue
                update = self._direction(tensor, group)
                for index, lo, hi in self._segments[id(tensor)]:
                    norms_sq[0, index] += tensor[lo:hi].float().square().sum()
                    norms_sq[1, index] += update[lo:hi].float().square().sum()
                pieces.append((tensor, update, group))
        if self._weights is not None:  # replicated parameters off tensor rank 0: entered by tensor rank 0
            norms_sq.mul_(torch.tensor(self._weights, dtype=norms_sq.dtype, device=norms_sq.device))
        # Every rank calls this, even with no pieces: the all-reduce must be issued symmetrically.
        self._all_reduce_sum(norms_sq)
        weight_norm, update_norm = norms_sq.sqrt()
        for tensor, update, group in pieces:
            trust = trust_ratio(weight_norm, update_norm, group)
            for index, lo, hi in self._segments[id(tensor)]:
                tensor[lo:hi].sub_(update[lo:hi] * (trust[index].item() * group["lr"]))
        return loss


def lamb_norm_axes(topology: Topology, sharded: bool) -> list[AxisGroup]:
    """Where the per-parameter table is summed: the data axis where the stage shards the optimizer tensors
    (``sharded``), the tensor axis where parameters are split over it; one all-reduce over the world when those
    two axes are the whole world. (Pipeline stages hold different parameters: never summed over the pipe axis.)"""
    axes = [topology.data] if sharded else []
    if topology.tensor.size > 1:
        axes.append(topology.tensor)
    if len(axes) == 2 and topology.pipe.size == 1 and topology.world.size > 1:
        return [topology.world]
    return axes


def sum_over(collectives: Collectives, axes: Sequence[AxisGroup], table: torch.Tensor) -> None:
    """All-reduce (sum) ``table`` over each of ``axes`` in turn (``lamb_norm_axes``), in place."""
    for axis in axes:
        collectives.all_reduce(table, axis, tag="lamb_norms")
