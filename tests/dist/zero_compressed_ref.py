"""Single-process reference of 1-bit Adam under ZeRO-1/2: simulated workers over the engine's bucket layout, each
bucket's compressed mean from ``mean_abs_reduce_scatter_reference`` (the same algorithm as
``MeanAbsReduceScatter``, one process)."""

from __future__ import annotations

import torch

from shardspeed.zero.compressed_adam import denominator, frozen_at, onebit_adam_update, preconditioned_update
from shardspeed.zero.compressed_scale import mean_abs_reduce_scatter_reference
from shardspeed.zero.layout import ShardLayout


class ZeroOneBitAdamReference:
    """All N workers in one process over the flat, bucketed layout: exact mean during the warm-up, the
    compressed mean (one error buffer per worker and bucket) after, OnebitAdam on the whole flat vector (element-wise,
    so the same as on each shard)."""

    def __init__(self, flat: torch.Tensor, layout: ShardLayout, world: int, *, lr: float, freeze_step: int,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:  # fmt: skip
        self.flat, self.layout, self.world = flat, layout, world
        self.lr, self.freeze_step, self.betas, self.eps, self.wd = lr, freeze_step, betas, eps, weight_decay
        self.m, self.v = torch.zeros_like(flat), torch.zeros_like(flat)
        chunk = [-(-(b.numel // world) // 8) * 8 for b in layout.buckets]
        self.errors = [[torch.zeros(world * c) for c in chunk] for _ in range(world)]
        self.step_count = 0

    def compressed_now(self) -> bool:
        return frozen_at(self.step_count + 1, self.freeze_step)

    def reduce(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        """Mean over workers of flat local gradients (compressed per bucket when in the compressed phase)."""
        if not self.compressed_now():
            return _exact_mean(local_grads)
        out = torch.zeros_like(self.flat)
        d = denominator(self.v, self.eps)
        for k, b in enumerate(self.layout.buckets):
            errors = [e[k] for e in self.errors]  # updated in place
            inputs = [g[b.start : b.end] * d[b.start : b.end] for g in local_grads]  # preconditioned
            slices = mean_abs_reduce_scatter_reference(inputs, errors)
            out[b.start : b.end] = torch.cat(slices)
        return out

    def step(self, grad: torch.Tensor) -> None:
        self.step_count += 1
        if self.step_count == 1:
            return
        if frozen_at(self.step_count, self.freeze_step):
            if not frozen_at(self.step_count - 1, self.freeze_step):
                self.m.mul_(denominator(self.v, self.eps))
            preconditioned_update(self.flat, grad, self.m, lr=self.lr, beta1=self.betas[0], weight_decay=self.wd)
            return
        onebit_adam_update(self.flat, grad, self.m, self.v, lr=self.lr, betas=self.betas, eps=self.eps,
                           weight_decay=self.wd, frozen=frozen_at(self.step_count, self.freeze_step))  # fmt: skip


def _exact_mean(local_grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(local_grads).sum(0) / len(local_grads)
