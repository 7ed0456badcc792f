"""Gradients of tensor-replicated parameters that each tensor rank computes only a part of.

[Note: partial gradients] Under sequence parallelism a layer norm (and a row-parallel layer's bias) is replicated
over the tensor axis but applied to this rank's sequence chunk only, so each tensor rank's gradient is a partial
sum; the true gradient is their sum. Megatron all-reduces these after backward (``allreduce_sequence_parallel_
grad``); here a tensor hook (``param.register_hook``, nothing stored on the parameter) sums the gradient over the
tensor axis *before* it is accumulated, so whatever runs next — the replicated stage's buffer, ZeRO 1/2's bucket
reduce-scatter over the data axis, ZeRO-3's unit staging, ``param.grad`` read by a script — sees the complete
gradient and needs to know nothing about tensor parallelism.
Why a hook and not an all-reduce at the step: the stages reduce over the data axis during backward (buckets launch
as they fill), so a later correction would come too late for stage 2's per-micro-step reduce-scatter.
Cost: one all-reduce per such parameter per backward pass (tag ``tp.partial_grad``); with gradient accumulation
that is once per micro-step (the sum is linear, so the result is the same as once per step).
Every tensor rank runs the same graph, so the hooks fire in the same order on every rank (collective order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardspeed.comm import Collectives
from shardspeed.params.spec import ParamSpecs
from shardspeed.topology import AxisGroup

PARTIAL_GRAD_TAG = "tp.partial_grad"


def partial_grad_params(module: nn.Module, specs: ParamSpecs) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of ``module`` whose spec says their gradient is partial, in registration order."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad and specs.of(p, name).partial_grad]


def _sum_over(axis: AxisGroup, collectives: Collectives) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)  # never in place: autograd owns ``grad``
        collectives.all_reduce(total, axis, tag=PARTIAL_GRAD_TAG)
        return total

    return hook


def register_partial_grad_hooks(
    module: nn.Module, specs: ParamSpecs, axis: AxisGroup, collectives: Collectives
) -> list[RemovableHandle]:
    """Sum every partial gradient of ``module``'s parameters over ``axis`` (the tensor axis) as autograd produces
    it ([Note: partial gradients]). Returns the hook handles (``handle.remove()`` undoes it); none on a size-1
    axis."""
    if axis.size == 1:
        return []
    hook = _sum_over(axis, collectives)
    return [p.register_hook(hook) for _, p in partial_grad_params(module, specs)]
