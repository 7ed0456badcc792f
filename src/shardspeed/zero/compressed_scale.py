"""The 1-bit code of the ZeRO-1/2 gradient path: error-fed signs with the L2-optimal scale, mean |x|.

[Note: mean-abs scale] DeepSpeed's compressed_allreduce scales the signs by RMS(x) = ‖x‖₂/√n. For a fixed sign
pattern the scale minimising the error ‖x − s·sign(x)‖₂ is s = mean |x|, and with it the error never grows:
‖x − s·sign(x)‖² = ‖x‖² − n·s² ≤ ‖x‖². With RMS the error is 2‖x‖² − 2·RMS·‖x‖₁, up to twice ‖x‖² when a few
elements dominate (heavy tails), and error feedback then feeds a growing error back in. The preconditioned
gradients of the ZeRO path ([Note: preconditioned compression]) are heavy-tailed (elements whose variance was
small in the warm-up). (The divergence first seen with RMS had another cause: β2 = 0.999 frozen at 15% of the run
diverges uncompressed too; RMS against mean |x| at a settled β2 has not been compared.)
``CompressedReduceScatter`` (compression/, DeepSpeed's RMS) is kept as is for the stage-0 optimizers, whose
DeepSpeed parity it serves, and this subclass changes only the scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardspeed.comm.work import Work
from shardspeed.compression.collective import CompressedReduceScatter, _ChainedWork, _check_input
from shardspeed.compression.signs import average_chunks, pack_signs


def compress_mean_abs_(x: Tensor, error: Tensor) -> tuple[Tensor, Tensor]:
    """``compression.signs.compress_`` with scale mean |x| ([Note: mean-abs scale]), in place: ``x += error``,
    ``error <- x - scale · sign(x)``; returns (packed signs, scale)."""
    x.add_(error)
    scale = x.abs().mean().reshape(1)
    signs = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    torch.sub(x, signs.mul_(scale), out=error)
    return pack_signs(x), scale


class MeanAbsReduceScatter(CompressedReduceScatter):
    """``CompressedReduceScatter`` with the mean-|x| scale (the same collectives, bytes and error buffers)."""

    def launch(self, shard: Tensor, unsharded: Tensor) -> Work:
        _check_input("MeanAbsReduceScatter (shard)", shard, self.slice)
        _check_input("MeanAbsReduceScatter (unsharded)", unsharded, self.numel)
        n, c = self.axis.size, self.collectives
        if n == 1:
            shard.view(-1).copy_(unsharded.view(-1))
            return Work(None)
        buffer = torch.zeros(n, self.chunk, device=self.device)
        buffer[:, : self.slice] = unsharded.view(n, self.slice)
        packed, scale = compress_mean_abs_(buffer.view(-1), self.worker_error)
        received, scales = torch.empty_like(packed), torch.empty(n, device=self.device)
        first = [
            c.all_to_all_single(received, packed, self.axis, async_op=True, tag=self.tag),
            c.all_gather(scales, scale, self.axis, async_op=True, tag=self.tag),
        ]
        keep = [packed, scale]  # gloo reads the packed input until phase one finished

        def own() -> None:
            shard.view(-1).copy_(average_chunks(received.view(n, -1), scales, self.slice))
            keep.clear()

        return _ChainedWork(first, own)


def mean_abs_reduce_scatter_reference(inputs: list[Tensor], worker_errors: list[Tensor]) -> list[Tensor]:
    """``MeanAbsReduceScatter`` for ``len(inputs)`` simulated workers in one process (tests, benchmarks)."""
    n, numel = len(inputs), inputs[0].numel()
    if n == 1:
        return [inputs[0].reshape(-1).float().clone()]
    piece = numel // n
    chunk = -(-piece // 8) * 8
    packs, scales = [], []
    for x, error in zip(inputs, worker_errors, strict=True):
        buffer = torch.zeros(n, chunk)
        buffer[:, :piece] = x.reshape(n, piece)
        packed, scale = compress_mean_abs_(buffer.view(-1), error)
        packs.append(packed.view(n, -1))
        scales.append(scale)
    worker_scales = torch.cat(scales)
    return [average_chunks(torch.stack([p[j] for p in packs]), worker_scales, piece) for j in range(n)]
