"""Flat gradient buffer: every trainable parameter's gradient lives in one contiguous buffer.

Two ways a parameter's gradient reaches the buffer (see [Note: gradient views]):
- ``as_views`` (fp32 training): ``param.grad`` *is* a view of the buffer, so autograd accumulates in place and no
  copy is made — the trick DDP calls gradient_as_bucket_view.
- otherwise (bf16/fp16 training with fp32 accumulation): autograd produces a low-precision ``param.grad``; the
  gradient-ready hook adds it into the fp32 buffer and drops it, so low-precision gradients never accumulate
  (fp32 accumulation across micro-steps avoids bf16 round-off swallowing small updates).

[Note: gradient views] If user code replaces ``param.grad`` (``optimizer.zero_grad(set_to_none=True)``), autograd
allocates a fresh gradient; the hook notices the storage is not ours, folds it into the buffer and re-points
``param.grad``. So gradients are never silently lost, only copied once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.zero.layout import FlatLayout


class FlatGradBuffer:
    """Owns the flat gradient storage for ``params`` packed in the given order."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype, as_views: bool, device: torch.device
    ) -> None:
        self.params = list(params)
        self.layout = FlatLayout.of([p.numel() for p in self.params])
        self.dtype = dtype
        self.as_views = as_views
        self.flat = torch.zeros(self.layout.total, dtype=dtype, device=device)
        self.views = [
            self.flat[s:e].view_as(p) for p, (s, e) in zip(self.params, map(self.layout.span, range(len(self.params))))
        ]
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
        view.add_(grad.reshape(view.shape).to(self.dtype))
        param.grad = view if self.as_views else None

    def zero(self) -> None:
        self.flat.zero_()
        if self.as_views:
            for p, v in zip(self.params, self.views):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                    p.grad = v

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
