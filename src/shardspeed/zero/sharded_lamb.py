"""LAMB over ZeRO shards: the per-parameter norms of the trust ratio are summed across shards.

A bucket shard holds pieces of several parameters (and maybe padding). Each rank computes the element-wise part of
the update on its pieces, adds the squares of each piece into a per-parameter table (two rows: ||w||², ||r||²),
and one all-reduce of that small table gives every rank the whole-parameter norms. Each piece is then scaled by
its own parameter's trust ratio — exactly what unsharded LAMB computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.optim.lamb import Lamb, trust_ratio

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
        **defaults: Any,
    ) -> None:
        super().__init__(param_groups, **defaults)
        self._segments = segments
        self._num_params = num_params
        self._all_reduce_sum = all_reduce_sum

    @classmethod
    def replacing(
        cls, lamb: Lamb, segments: dict[int, Segments], num_params: int, all_reduce_sum: Callable[[torch.Tensor], None]
    ) -> ShardedLamb:
        """A ShardedLamb with ``lamb``'s groups and hyperparameters (its state must be empty)."""
        if lamb.state:
            raise ValueError("pass a fresh Lamb optimizer: it already has state")
        return cls(
            [dict(g) for g in lamb.param_groups],
            segments=segments,
            num_params=num_params,
            all_reduce_sum=all_reduce_sum,
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
        # Every rank calls this, even with no pieces: the all-reduce must be issued symmetrically.
        self._all_reduce_sum(norms_sq)
        weight_norm, update_norm = norms_sq.sqrt()
        for tensor, update, group in pieces:
            trust = trust_ratio(weight_norm, update_norm, group)
            for index, lo, hi in self._segments[id(tensor)]:
                tensor[lo:hi].sub_(update[lo:hi] * (trust[index].item() * group["lr"]))
        return loss
