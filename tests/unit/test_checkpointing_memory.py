"""Activation memory of an L-block model, measured by torch's allocation tracker (MemTracker, works on CPU).

Bound from the issue: checkpointing every block keeps L block inputs plus one block's activations during its
recompute, so its peak is at most (L·b_in + b_block) / (L·b_block) of the plain run's, plus 5% of the plain
run's (the backward's transient gradient buffers, about a third of one block's activations here, which the
formula leaves out). b_in and b_block are measured on the plain model alone: b_in is a block input's size,
b_block what one plain block forward adds to the tracked memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from shardspeed import checkpointing
from shardspeed.checkpointing import CheckpointingContext
from shardspeed.config.activation import ActivationCheckpointingConfig

L, N, H = 8, 256, 32
CPU = torch.device("cpu")
Forward = Callable[[nn.ModuleList, torch.Tensor], torch.Tensor]


def make_model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * H, H)) for _ in range(L)
    )


def plain(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def checkpointed(**options: bool) -> Forward:
    ctx = CheckpointingContext(ActivationCheckpointingConfig(**options))
    return lambda blocks, x: checkpointing.run_blocks(blocks, x, context=ctx)


def total(tracker: MemTracker, kind: str = "current") -> int:
    return tracker.get_tracker_snapshot(kind)[CPU]["Total"]


def measure(tracker: MemTracker, blocks: nn.ModuleList, x: torch.Tensor, forward: Forward) -> dict[str, int]:
    """Peak tracked bytes during forward + backward, and bytes alive after the forward, above the entry state
    (parameters, the input, and gradients — allocated by a warm-up pass so they are not part of the peak)."""
    forward(blocks, x).square().sum().backward()
    blocks.zero_grad(set_to_none=False)
    tracker.track_external(blocks)  # again, now that the gradients exist: they belong to the entry state
    with tracker:
        base = total(tracker)
        out = forward(blocks, x)
        after_forward = total(tracker) - base
        out.square().sum().backward()
        del out
    tracker.reset_mod_stats()
    return {"peak": total(tracker, "peak") - base, "after_forward": after_forward}


def block_bytes(blocks: nn.ModuleList, x: torch.Tensor) -> int:
    """b_block: what one plain block's forward adds to the tracked memory (its saved activations + output)."""
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    with tracker:
        base = total(tracker)
        out = blocks[0](x)
        added = total(tracker) - base
    del out
    return added


def test_checkpointing_every_block_meets_the_memory_bound() -> None:
    blocks, x = make_model(), torch.randn(N, H)
    b_in, b_block = x.numel() * x.element_size(), block_bytes(make_model(), torch.randn(N, H))
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    base = measure(tracker, blocks, x, plain)
    ckpt = measure(tracker, blocks, x, checkpointed())
    cpu = measure(tracker, blocks, x, checkpointed(cpu_checkpointing=True))
    # The plain run is what the bound's model says: L blocks' activations, plus transients under one block's.
    assert L * b_block <= base["peak"] < (L + 1) * b_block
    assert base["after_forward"] == L * b_block
    bound = (L * b_in + b_block) / (L * b_block)
    assert ckpt["peak"] <= (bound + 0.05) * base["peak"], (ckpt, base, bound)
    assert ckpt["after_forward"] == L * b_in  # the inputs of blocks 1..L-1 plus the output; nothing else
    assert cpu == ckpt  # on a CPU-only host, cpu_checkpointing stores the same tensors


@pytest.mark.parametrize("every", [2, 4])
def test_every_kth_block_keeps_the_other_blocks_activations(every: int) -> None:
    blocks, x = make_model(), torch.randn(N, H)
    b_in, b_block = x.numel() * x.element_size(), block_bytes(make_model(), torch.randn(N, H))
    ctx = CheckpointingContext()
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    kept = measure(tracker, blocks, x, lambda b, h: checkpointing.run_blocks(b, h, every=every, context=ctx))
    checkpointed_blocks = L // every
    assert kept["after_forward"] == checkpointed_blocks * b_in + (L - checkpointed_blocks) * b_block
