"""params/assemble.py: every tensor rank's local slices placed back into the global tensor (pure, no process group)."""

from __future__ import annotations

import pytest
import torch

from shardspeed.params.assemble import assemble_global, max_local_shape
from shardspeed.params.spec import ParamSpec

SPECS = {
    "rows": ParamSpec((7, 3), partition_dim=0),  # ceil chunks: the last rank holds less
    "cols": ParamSpec((3, 10), partition_dim=1),
    "fused_qkv_conv1d": ParamSpec((4, 12), partition_dim=1, parts=3),  # GPT-2's c_attn: [in, 3·out]
    "fused_rows": ParamSpec((18, 2), partition_dim=0, parts=3),
    "vocab_padded": ParamSpec((37, 4), partition_dim=0, padded=38),
    "tiny": ParamSpec((1, 2), partition_dim=0),  # ranks past the first hold nothing
    "replicated": ParamSpec((5,)),
}


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_slices_assemble_to_the_global_tensor(name: str, size: int) -> None:
    spec = SPECS[name]
    if spec.padded is not None and spec.padded % size:
        spec = ParamSpec(spec.global_shape, partition_dim=0, padded=40)
    full = torch.arange(torch.Size(spec.global_shape).numel(), dtype=torch.float32).view(spec.global_shape) + 1
    local = [spec.slice_global(full, r, size) for r in range(size)]
    assert torch.equal(assemble_global(spec, local), full)
    # padded to the largest local shape (what an equal-sized all-gather carries): only the boxes are read
    shape = max_local_shape(spec, size)
    padded = []
    for t in local:
        p = torch.full(shape, float("nan"))
        p[tuple(slice(0, n) for n in t.shape)] = t
        padded.append(p)
    assert torch.equal(assemble_global(spec, padded), full)


def test_fused_parts_interleave_per_rank() -> None:
    """Rank r holds slice r of q, of k and of v: the global tensor keeps q | k | v whole, as the dense layer."""
    spec = SPECS["fused_qkv_conv1d"]
    full = torch.arange(48.0).view(4, 12)
    rank0, rank1 = spec.slice_global(full, 0, 2), spec.slice_global(full, 1, 2)
    assert torch.equal(rank0, torch.cat([full[:, 0:2], full[:, 4:6], full[:, 8:10]], dim=1))
    assert torch.equal(assemble_global(spec, [rank0, rank1]), full)
