"""Flat gradient buffer: every trainable parameter's gradient lives in one contiguous (padded) buffer.

Two ways a parameter's gradient reaches the buffer (see [Note: gradient views]):
- ``as_views`` (fp32 training): ``param.grad`` *is* a view of the buffer, so autograd accumulates in place and no
  copy is made — the trick DDP calls gradient_as_bucket_view.
- otherwise (bf16/fp16 training with fp32 accumulation): autograd produces a low-precision ``param.grad``; the
  gradient-ready hook adds it into the fp32 buffer and drops it, so low-precision gradients never accumulate
  (fp32 accumulation across micro-steps keeps bf16 round-off from swallowing small updates).

[Note: gradient views] If user code replaces ``param.grad`` (``optimizer.zero_grad(set_to_none=True)``), autograd
allocates a fresh gradient; the hook notices the storage is not ours, folds it into the buffer and re-points
``param.grad``. So gradients are never silently lost, only copied once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.zero.layout import ShardLayout


def param_views(flat: torch.Tensor, layout: ShardLayout, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each parameter, at the layout's offsets."""
    return [flat[s:e].view_as(p) for p, (s, e) in zip(params, map(layout.span, range(len(params))))]


class FlatGradBuffer:
    """Owns the flat gradient storage for ``params`` packed by ``layout``."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: ShardLayout,
        dtype: torch.dtype,
        as_views: bool,
        device: torch.device,
    ) -> None:
        self.params = list(params)
        self.layout = layout
        self.dtype = dtype
        self.as_views = as_views
        self.flat = torch.zeros(layout.total, dtype=dtype, device=device)
        self.views = param_views(self.flat, layout, self.params)
        if as_views:
            for p, v in zip(self.params, self.views):
                p.grad = v

    def absorb(self, index: int, param: torch.nn.Parameter) -> None:
        """Make sure parameter ``index``'s fresh gradient is in the buffer (called from its gradient-ready hook)."""
        grad = param.grad
        if grad is None:
            return
        view = self.views[index]
        if self.as_views and grad.data_ptr() == view.data_ptr():
            return  # autograd accumulated in place
        view.add_(grad.reshape(view.shape))
        param.grad = view if self.as_views else None

    def zero(self) -> None:
        self.flat.zero_()
        if self.as_views:
            for p, v in zip(self.params, self.views):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                    p.grad = v

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
