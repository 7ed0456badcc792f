"""The arrival-order re-layout (zero/arrival_order.py) under a streamed offload optimizer (``StreamedAdam``).

[Note: re-layout with a streamed optimizer] A torch optimizer's tensors can simply be swapped for the new
layout's; a ``StreamedAdam`` also cut them into chunks whose states live in a store (an NVMe swap file sized from
those chunks, or pinned host tensors), copies their gradients to the host per bucket (host_grads.py) and, under
bf16/fp16, holds the fp32 masters itself ([Note: masters in the store] in offload/optimizer.py). So, once, before
the first step:

1. whether there is state to keep is agreed (one scalar all-reduce): only a checkpoint loaded before the first
   backward leaves any (a step count above 0, or fp32 masters in the store finer than the parameters). If so,
   each old stepped tensor's moments and fp32 values are read out of the store (this rank's 3·4Ψ/N bytes, held
   on the training device until moved, once per resumed run);
2. the stage takes its masters back (a master shard seeded from the parameters) and re-lays out as with a torch
   optimizer (``_relayout``), which moves the read-out states with one all-gather per per-element tensor
   (zero/relayout_state.py) and the masters likewise;
3. the masters are handed over again (new stand-ins), the wrapped optimizer's groups get the new tensors and the
   ``StreamedAdam`` rebuilds its chunks, host-gradient buffers and store (``relayout``: the old swap file is
   closed, freeing its space, before the new one is opened, collectively);
4. kept states and masters are written into the new store (``load_state``).

A fresh run pays for one extra seeding of the store (the values and zero moments written at construction for
the initial layout are dropped).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.zero.layout import ShardLayout
from shardspeed.zero.relayout_state import reshard

if TYPE_CHECKING:
    from shardspeed.offload.optimizer import StreamedAdam
    from shardspeed.zero.partitioned import PartitionedStates


@dataclass
class HeldStates:
    """Optimizer states read out of a streamed optimizer's store, keyed by stepped tensor as a torch optimizer's
    ``state`` is (what ``carry_shard_states`` moves)."""

    state: defaultdict[torch.Tensor, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))


@torch.no_grad()
def relayout_streamed(
    states: PartitionedStates, layout: ShardLayout, optimizer: StreamedAdam, groups: list[dict[str, Any]]
) -> None:
    """Re-lay ``states`` out as ``layout`` and rebuild ``optimizer`` for its new stepped tensors, keeping any
    loaded state (see [Note: re-layout with a streamed optimizer]). Collective over the data axis."""
    old_tensors, old_layout, device = states.bucket_tensors, states.layout, states.device
    rank, in_store = states.ctx.axis.rank, optimizer.values_in_store
    carry = _any_rank(states, _has_state(states, optimizer))
    held = HeldStates()
    masters: torch.Tensor | None = None
    if carry:
        for tensor in old_tensors:
            entry = optimizer.read_state(tensor)
            held.state[tensor] = {k: v.to(device) if v.dim() > 0 else v for k, v in entry.items()}
        if in_store:
            masters = torch.cat([optimizer.read_values(t).to(device) for t in old_tensors])
    states.masters_in_optimizer = False  # _relayout rebuilds a master shard from the parameters
    states._relayout(layout, held)  # type: ignore[arg-type]  # moves held.state (a torch optimizer's protocol)
    if masters is not None:
        assert states.master_shard is not None
        states.master_shard.copy_(reshard(masters, old_layout, layout, rank, states._gather))
    carried = [held.state.pop(t, None) for t in states.bucket_tensors]
    master_shard = states.master_shard
    access = states.hand_masters_to_optimizer() if in_store else None
    for group, new in zip(optimizer.param_groups, states.optimizer_groups(groups)):
        group["params"] = new["params"]
    optimizer.relayout(access)
    if not carry:
        return
    for k, (tensor, entry) in enumerate(zip(states.bucket_tensors, carried)):
        values = None
        if in_store:
            assert master_shard is not None
            lo, hi = layout.shard_offset(k)
            values = master_shard[lo:hi].to("cpu")
        on_host = {key: v.to("cpu") if v.dim() > 0 else v for key, v in (entry or {}).items()}
        optimizer.load_state(tensor, on_host, values)


def _has_state(states: PartitionedStates, optimizer: StreamedAdam) -> bool:
    """Whether this rank's optimizer holds anything a fresh one would not: steps taken (a loaded checkpoint), or
    fp32 masters that differ from the low-precision parameters."""
    if any(optimizer.steps):
        return True
    if not optimizer.values_in_store:
        return False
    for k, tensor in enumerate(states.bucket_tensors):
        params = states.param_flat[slice(*states.layout.rank_slice(k, states.ctx.axis.rank))]
        if not torch.equal(optimizer.read_values(tensor), params.float().cpu()):
            return True
    return False


def _any_rank(states: PartitionedStates, flag: bool) -> bool:
    value = torch.tensor([float(flag)], device=states.device)
    states.ctx.collectives.all_reduce_max(value, states.ctx.axis, tag="relayout")
    return value.item() > 0
