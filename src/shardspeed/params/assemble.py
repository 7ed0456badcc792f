"""Global tensors from the tensor ranks' local pieces, and the reverse: pure placement by the specs' boxes.

[Note: full weights under tensor parallelism] What a user saves (``save_16bit_model``, ``module_state_dict()``, the
HF Trainer's ``save_model``) must be exactly what the dense model's ``state_dict()`` holds: global shapes, no
vocabulary padding, fused QKV blocks in the dense layout. Each rank holds ``spec.boxes(rank, size)`` of every
partitioned tensor, so the global tensor is rebuilt by copying every rank's boxes into place; padding lies outside
every box and is dropped by construction. The collective half (gathering the ranks' local tensors over the tensor
axis, one parameter at a time) lives in ``tensor_parallel/full_weights.py``; this half needs no process group, so
tests and tools assemble with it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.params.spec import Box, ParamSpec


def place_box(local: torch.Tensor, box: Box, full: torch.Tensor) -> None:
    """Copy ``box`` of the local tensor into its place in the global ``full`` tensor."""
    src, dst = local, full
    for d, (lo, go, n) in enumerate(zip(box.local_offset, box.global_offset, box.shape, strict=True)):
        src, dst = src.narrow(d, lo, n), dst.narrow(d, go, n)
    dst.copy_(src)


def max_local_shape(spec: ParamSpec, tp_size: int) -> tuple[int, ...]:
    """The largest local shape over the tensor ranks (ceil chunks: the last rank may hold less), which an
    equal-sized all-gather pads every rank's tensor to."""
    shapes = [spec.local_shape(r, tp_size) for r in range(tp_size)]
    return tuple(max(dims) for dims in zip(*shapes, strict=True))


def assemble_global(spec: ParamSpec, local_by_rank: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global tensor of ``spec`` from every tensor rank's local tensor (index = tensor rank). A replicated spec
    returns tensor rank 0's copy. Local tensors may be larger than the rank's local shape (padded for a gather):
    only the boxes are read."""
    size = len(local_by_rank)
    if not spec.partitioned:
        return local_by_rank[0]
    first = local_by_rank[0]
    full = torch.zeros(spec.global_shape, dtype=first.dtype, device=first.device)
    for rank, local in enumerate(local_by_rank):
        for box in spec.boxes(rank, size):
            place_box(local, box, full)
    return full
