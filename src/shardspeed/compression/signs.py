"""Sign packing and error-fed 1-bit compression: pure tensor math, no processes ([Note: 1-bit compression]).

[Note: 1-bit compression] DeepSpeed's 1-bit optimizers (Tang et al., "1-bit Adam", 2021) send each element as its
sign plus one fp32 scale per chunk, ``scale = ||x|| / sqrt(n)`` of the error-compensated chunk ``x``: the scale
that keeps the chunk's l2 norm (``||scale · sign(x)|| = ||x||``). What the rounding loses is kept locally as the
*error* and added to the next call's input (error feedback), so the running sum of what was sent tracks the
running sum of the inputs within one step's error — the error stays bounded instead of accumulating. Signs follow
DeepSpeed: ``x >= 0`` is +1 (``sign(x) + 1`` as bool), so a zero sends +1. Bits are packed 8 per byte, first
element in the most significant bit (numpy's and cupy's ``packbits`` order, DeepSpeed's packer), padded with zero
bits (-1) up to a whole byte.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def packed_size(numel: int) -> int:
    """Bytes that hold ``numel`` signs."""
    return (numel + 7) // 8


def pack_signs(x: Tensor) -> Tensor:
    """uint8 tensor of ``packed_size(x.numel())`` bytes: bit 1 where ``x >= 0``, MSB first, zero-padded."""
    flat = x.reshape(-1)
    bits = torch.zeros(packed_size(flat.numel()) * 8, dtype=torch.uint8, device=flat.device)
    bits[: flat.numel()] = flat >= 0
    weights = _BIT_WEIGHTS.to(flat.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The first ``numel`` signs of ``packed`` as ±1.0 values of ``dtype``."""
    if numel > packed.numel() * 8:
        raise ValueError(f"unpack_signs: {packed.numel()} bytes hold at most {packed.numel() * 8} signs, not {numel}")
    weights = _BIT_WEIGHTS.to(packed.device)
    bits = (packed.reshape(-1, 1) & weights).ne(0).reshape(-1)[:numel]
    return bits.to(dtype).mul_(2).sub_(1)


def scale_of(x: Tensor) -> Tensor:
    """DeepSpeed's chunk scale ``||x|| / sqrt(n)`` (fp32, a 1-element tensor); n counts padding zeros too."""
    return (torch.linalg.norm(x.float()) / math.sqrt(x.numel())).reshape(1)


def compress_(x: Tensor, error: Tensor) -> tuple[Tensor, Tensor]:
    """Error-fed 1-bit compression of the fp32 chunk ``x``, in place: ``x += error`` (compensation), then
    ``error <- x - scale · sign(x)``. Returns (packed signs of the compensated ``x``, its scale). ``x`` keeps the
    compensated values (the caller may reuse it as scratch)."""
    if x.shape != error.shape:
        raise ValueError(f"compress_: input {tuple(x.shape)} and error buffer {tuple(error.shape)} differ")
    x.add_(error)
    scale = scale_of(x)
    signs = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    torch.sub(x, signs.mul_(scale), out=error)
    return pack_signs(x), scale


def decompress(packed: Tensor, scale: Tensor, numel: int) -> Tensor:
    """``scale · sign`` of ``numel`` fp32 values (the receiver's view of one compressed chunk)."""
    return unpack_signs(packed, numel).mul_(scale)


def average_chunks(packed: Tensor, scales: Tensor, numel: int) -> Tensor:
    """The server step of DeepSpeed's compressed all-reduce: the mean over N workers of their decompressed copies
    of one chunk. ``packed``: (N, bytes) signs, ``scales``: (N,) worker scales. Same operation order as
    DeepSpeed (``unpack · (scales / N)`` summed over workers), so a one-process reference agrees to the bit."""
    n = packed.shape[0]
    signs = unpack_signs(packed.reshape(-1), n * packed.shape[1] * 8).view(n, -1)[:, :numel]
    return signs.mul_(scales.reshape(n, 1).float().mul(1 / n)).sum(0)


def padded_numel(numel: int, world: int) -> int:
    """DeepSpeed's padded size for a compressed all-reduce over ``world`` ranks: a multiple of
    ``world × lcm(world, 8)``, so each rank's chunk is a whole number of bytes (OnebitAdam's
    ``corrected_tensor_size``; padding zeros count in the worker scale's ``sqrt(n)``, as there)."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit
