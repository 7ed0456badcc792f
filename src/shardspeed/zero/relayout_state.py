"""Moving fp32 masters and optimizer states from one bucket layout to another (the arrival-order re-layout).

Before the first step there is nothing to move but parameter values and gradients. A checkpoint loaded before
the first backward, though, leaves fp32 masters that differ from the low-precision parameters and optimizer
states keyed by the old layout's tensors; they must follow the parameters into the new layout.

Stage 0 steps one tensor per parameter, so its states only change keys. Stages 1/2 step one bucket-major shard
per bucket ([Note: bucket-major sharding] in zero/layout.py): in the new layout this rank owns other elements,
held today by other ranks, so each per-element flat tensor is all-gathered once (``layout.total`` elements,
transient, once per run) and this rank's new slices are read out of it parameter by parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardspeed.zero.layout import ShardLayout, intersect

Gather = Callable[[torch.Tensor], torch.Tensor]  # every rank's equal-sized tensor, back to back (collective)


def reshard(values: torch.Tensor, old: ShardLayout, new: ShardLayout, rank: int, gather: Gather) -> torch.Tensor:
    """This rank's shard under ``new`` of the flat per-element tensor whose shard under ``old`` is ``values``
    (``old.shard_numel`` elements; padding comes out zero). Collective: every rank calls it."""
    world = old.world
    everyone = gather(values.contiguous()).view(world, old.shard_numel)
    old_bucket = {i: k for k, b in enumerate(old.buckets) for i in b.members}
    out = torch.zeros(new.shard_numel, dtype=values.dtype, device=values.device)
    for k, bucket in enumerate(new.buckets):
        start, end = new.rank_slice(k, rank)
        base = new.shard_offset(k)[0] - start  # new flat position → index into ``out``
        for i in bucket.members:
            lo, hi = new.span(i)
            owned = intersect((lo, hi), (start, end))
            if owned is None:
                continue
            old_lo = old.span(i)[0]
            ob = old.buckets[old_bucket[i]]
            share = ob.numel // world
            # parameter i's elements [owned - lo) sit at old flat [old_lo + …), split over the old rank slices
            want = (old_lo + owned[0] - lo, old_lo + owned[1] - lo)
            for r in range(world):
                piece = intersect(want, (ob.start + r * share, ob.start + (r + 1) * share))
                if piece is None:
                    continue
                src = ob.start // world + piece[0] - (ob.start + r * share)
                dst = base + lo + piece[0] - old_lo
                out[dst : dst + piece[1] - piece[0]] = everyone[r, src : src + piece[1] - piece[0]]
    return out


def carry_shard_states(
    optimizer: torch.optim.Optimizer,
    old_tensors: Sequence[torch.Tensor],
    new_tensors: Sequence[torch.Tensor],
    old: ShardLayout,
    new: ShardLayout,
    rank: int,
    gather: Gather,
) -> None:
    """Stages 1/2: re-key the optimizer's per-bucket states to ``new_tensors`` (one per new bucket), resharding
    every per-element state. Scalar states (Adam's ``step``) are the same for every bucket and are copied."""
    states = [optimizer.state.pop(t, None) for t in old_tensors]
    present = [s for s in states if s]
    if not present:
        return
    assert len(present) == len(states), "some buckets have optimizer state and others not"
    template = present[0]
    for key, value in template.items():
        per_element = isinstance(value, torch.Tensor) and value.dim() > 0
        if per_element:
            flat = torch.cat([s[key].reshape(-1) for s in states])
            moved = reshard(flat, old, new, rank, gather)
        for k, tensor in enumerate(new_tensors):
            state = optimizer.state[tensor]
            if per_element:
                lo, hi = new.shard_offset(k)
                state[key] = moved[lo:hi].view_as(tensor).clone()
            else:
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value


def carry_param_states(optimizer: torch.optim.Optimizer, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Stage 0: the same parameters, new tensors: each state moves to its parameter's new tensor."""
    for old, new in pairs:
        if old is not new and old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)
