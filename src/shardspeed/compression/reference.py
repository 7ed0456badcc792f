"""The compressed collectives of ``compression/collective.py`` for N simulated workers in one process: pure
functions, the references the multi-rank tests compare with (and what B/C's optimizer tests can reuse).

Each function takes every worker's input and error buffers (updated in place, as the ranks would update theirs)
and runs the same steps with the same functions of ``compression/signs.py``, so the results agree bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardspeed.compression.signs import average_chunks, compress_, padded_numel, unpack_signs


def compressed_allreduce(inputs: list[Tensor], worker_errors: list[Tensor], server_errors: list[Tensor]) -> Tensor:
    """[Note: compressed all-reduce] over ``len(inputs)`` workers: the result every rank receives (flat fp32).
    Error buffers: ``padded_numel(numel, N)`` per worker, ``padded / N`` per server; one worker is exact."""
    n, numel = len(inputs), inputs[0].numel()
    if n == 1:
        return inputs[0].reshape(-1).float().clone()
    padded = padded_numel(numel, n)
    chunk = padded // n
    packs, scales = [], []
    for x, error in zip(inputs, worker_errors, strict=True):
        buffer = torch.zeros(padded)
        buffer[:numel] = x.reshape(-1)
        packed, scale = compress_(buffer, error)
        packs.append(packed.view(n, -1))
        scales.append(scale)
    worker_scales = torch.cat(scales)
    server_packs, server_scales = [], []
    for j in range(n):  # server j: everyone's chunk j
        mean = average_chunks(torch.stack([p[j] for p in packs]), worker_scales, chunk)
        packed, scale = compress_(mean, server_errors[j])
        server_packs.append(packed)
        server_scales.append(scale)
    out = unpack_signs(torch.cat(server_packs), padded).view(n, -1).mul_(torch.cat(server_scales).view(n, 1))
    return out.view(-1)[:numel]


def compressed_reduce_scatter(inputs: list[Tensor], worker_errors: list[Tensor]) -> list[Tensor]:
    """The compressed reduce-scatter over ``len(inputs)`` workers: each rank's fp32 slice of the mean. Worker
    errors: ``N × chunk`` (each slice padded to a multiple of 8) per worker."""
    n, numel = len(inputs), inputs[0].numel()
    if n == 1:
        return [inputs[0].reshape(-1).float().clone()]
    piece = numel // n
    chunk = -(-piece // 8) * 8
    packs, scales = [], []
    for x, error in zip(inputs, worker_errors, strict=True):
        buffer = torch.zeros(n, chunk)
        buffer[:, :piece] = x.reshape(n, piece)
        packed, scale = compress_(buffer.view(-1), error)
        packs.append(packed.view(n, -1))
        scales.append(scale)
    worker_scales = torch.cat(scales)
    return [average_chunks(torch.stack([p[j] for p in packs]), worker_scales, piece) for j in range(n)]
