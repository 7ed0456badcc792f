"""Global gradient norm and clipping coefficient.

The norm is accumulated in fp32 as a sum of squares so that sharded callers (ZeRO) can add their partial sums
across ranks with one scalar all-reduce before taking the square root. A non-finite sum means overflow.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Σ x² over all elements of all tensors, as a 1-element fp32 tensor (inf/nan propagate). ``device``: where the
    zero of an empty list lives (a rank that counts nothing still all-reduces its partial sum)."""
    total: torch.Tensor | None = None
    for t in tensors:
        partial = torch.linalg.vector_norm(t, dtype=torch.float32).square()
        total = partial if total is None else total + partial
    return total.reshape(1) if total is not None else torch.zeros(1, device=device)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their global norm is at most ``max_norm`` (1.0 when off).

    Same formula as ``torch.nn.utils.clip_grad_norm_`` (including its 1e-6 guard), so clipped runs match torch.
    """
    if max_norm <= 0.0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
