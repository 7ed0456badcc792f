"""fp32 master weights for bf16/fp16 training.

The model keeps low-precision parameters (2Ψ bytes) for forward/backward; the optimizer steps fp32 copies (4Ψ)
packed in the same flat layout as the fp32 gradient buffer, so ``master[i].grad`` is simply the buffer's view i
and no gradient is ever copied for the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.zero.grad_buffer import FlatGradBuffer


class MasterWeights:
    def __init__(self, params: Sequence[torch.nn.Parameter], grads: FlatGradBuffer) -> None:
        assert grads.dtype == torch.float32 and not grads.as_views, "master weights pair with an fp32 grad buffer"
        self.params = list(params)
        self.flat = torch.zeros(grads.layout.total, dtype=torch.float32, device=grads.flat.device)
        self.masters: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            start, end = grads.layout.span(i)
            master = self.flat[start:end].view_as(p)
            master.copy_(p.detach())
            master.grad = grads.views[i]
            self.masters.append(master)
        self.master_of = {id(p): m for p, m in zip(self.params, self.masters)}

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
