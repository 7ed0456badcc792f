"""Single-process reference of 1-bit Adam under ZeRO-1/2: simulated workers over the engine's bucket layout, each
bucket's compressed mean of the raw local gradients from ``compression.reference.compressed_reduce_scatter`` (A's
one-process form of ``CompressedReduceScatter``). The optimizer math is written out here, from DeepSpeed's
OnebitAdam (0.19.6, runtime/fp16/onebit/adam.py), independently of zero/compressed_adam.py."""

from __future__ import annotations

import torch

from shardspeed.compression.reference import compressed_reduce_scatter
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
        self.frozen = False  # DeepSpeed's adam_freeze_key

    def compressed_now(self) -> bool:
        return self.frozen

    def reduce(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        """Mean over workers of flat local gradients (compressed per bucket when in the compressed phase)."""
        if not self.compressed_now():
            return torch.stack(local_grads).sum(0) / len(local_grads)
        out = torch.zeros_like(self.flat)
        for k, b in enumerate(self.layout.buckets):
            errors = [e[k] for e in self.errors]  # updated in place
            slices = compressed_reduce_scatter([g[b.start : b.end].clone() for g in local_grads], errors)
            out[b.start : b.end] = torch.cat(slices)
        return out

    def step(self, grad: torch.Tensor) -> None:
        """DeepSpeed's OnebitAdam.step on the mean gradient: the first call only initialises; no bias correction;
        ``eps`` outside the root; decoupled weight decay; the freeze key set at the end of a step whose count has
        reached ``freeze_step`` (never on the first call)."""
        self.step_count += 1
        if self.step_count > 1:
            b1, b2 = self.betas
            # DeepSpeed's in-place op order (so the rounding, hence the 1-bit signs, agree bit for bit)
            self.m.mul_(b1).add_(grad, alpha=1 - b1)
            if not self.frozen:
                self.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            update = self.m / (self.v.sqrt() + self.eps)
            if self.wd > 0.0:
                update += self.wd * self.flat
            self.flat.add_(-self.lr * update)
            if self.step_count >= self.freeze_step:
                self.frozen = True
