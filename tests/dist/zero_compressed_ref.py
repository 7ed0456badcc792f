"""Single-process reference of 1-bit Adam under ZeRO-1/2 (simulated workers over the engine's bucket layout), and
the error-fed 1-bit mean it compresses buckets with.

``sign_compress`` is the worker step of DeepSpeed's compressed_allreduce (error added, one scale per worker's
buffer = ‖buffer‖₂/√numel, signs with 0 → +1, the residual kept as the new error); the mean over ranks is the mean
of the compressed buffers. The dist tests run the engine with ``GatherCompressor`` (the same math through a plain
fp32 all-gather: traffic is not the point there) or compression/'s ``CompressedReduceScatter``.
"""

from __future__ import annotations

import math

import torch

from shardspeed.comm import Work
from shardspeed.zero.compressed_adam import frozen_at, onebit_adam_update
from shardspeed.zero.layout import ShardLayout


def sign_compress(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(compressed x + error, new error)."""
    buf = x + error
    scale = buf.norm() / math.sqrt(buf.numel())
    comp = scale * torch.where(buf >= 0, 1.0, -1.0)
    return comp, buf - comp


class GatherCompressor:
    """``BucketCompressor`` with the reference math, over a plain all-gather (tests only)."""

    def __init__(self, numel: int, axis, collectives, device: torch.device) -> None:
        self.axis, self.collectives = axis, collectives
        self.error = torch.zeros(numel, device=device)

    @property
    def error_bytes(self) -> int:
        return self.error.numel() * 4

    def launch(self, shard: torch.Tensor, unsharded: torch.Tensor) -> Work:
        comp, self.error = sign_compress(unsharded, self.error)
        n = self.axis.size
        out = torch.empty(comp.numel() * n)
        self.collectives.all_gather(out, comp, self.axis, tag="grads_ref")
        mean = out.view(n, -1).sum(0) / n
        share = comp.numel() // n
        shard.copy_(mean[self.axis.rank * share : (self.axis.rank + 1) * share])
        return Work(None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"worker_error": self.error.clone()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.error.copy_(sd["worker_error"])

    def reset(self) -> None:
        self.error.zero_()


class ZeroOneBitAdamReference:
    """All N workers in one process over the flat, bucketed layout: exact mean during the warm-up, the
    compressed mean (one error buffer per worker and bucket) after, OnebitAdam on the whole flat vector (element-wise,
    so the same as on each shard)."""

    def __init__(self, flat: torch.Tensor, layout: ShardLayout, world: int, *, lr: float, freeze_step: int,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:  # fmt: skip
        self.flat, self.layout, self.world = flat, layout, world
        self.lr, self.freeze_step, self.betas, self.eps, self.wd = lr, freeze_step, betas, eps, weight_decay
        self.m, self.v = torch.zeros_like(flat), torch.zeros_like(flat)
        self.errors = [[torch.zeros(b.numel) for b in layout.buckets] for _ in range(world)]
        self.step_count = 0

    def compressed_now(self) -> bool:
        return frozen_at(self.step_count + 1, self.freeze_step)

    def reduce(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        """Mean over workers of flat local gradients (compressed per bucket when in the compressed phase)."""
        if not self.compressed_now():
            return _exact_mean(local_grads)
        out = torch.zeros_like(self.flat)
        for k, b in enumerate(self.layout.buckets):
            comps = []
            for r, g in enumerate(local_grads):
                comp, self.errors[r][k] = sign_compress(g[b.start : b.end], self.errors[r][k])
                comps.append(comp)
            out[b.start : b.end] = torch.stack(comps).sum(0) / self.world
        return out

    def step(self, grad: torch.Tensor) -> None:
        self.step_count += 1
        if self.step_count == 1:
            return
        onebit_adam_update(self.flat, grad, self.m, self.v, lr=self.lr, betas=self.betas, eps=self.eps,
                           weight_decay=self.wd, frozen=frozen_at(self.step_count, self.freeze_step))  # fmt: skip


def _exact_mean(local_grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(local_grads).sum(0) / len(local_grads)
