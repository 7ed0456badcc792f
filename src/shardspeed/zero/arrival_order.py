"""Bucket layout from the order gradients actually become ready: one order, agreed across the data axis.

[Note: arrival-order layout] Buckets launch in bucket order ([Note: launch order] in zero/reducer.py), so they only
overlap backward if bucket order is the order gradients become ready. The initial layout guesses that order as
reverse registration, which is wrong whenever forward order differs from registration order (heads and embeddings
registered first, adapters last, a decoder that runs its blocks in another order…); then nothing launches until
backward ends and, at stage 2, every bucket's staging is alive at once. So the first backward through
``engine.backward`` only *records* the order its gradients arrive in, and after autograd returns:

1. every rank sends (its trainable parameter names, its arrival order completed with the parameters that got no
   gradient) to every other (one small all-gather over the data axis). Each rank checks that all ranks have the
   same parameter set — the same error on every rank, no hang — and takes data-parallel rank 0's order, so all
   ranks build the same layout;
2. the layout is rebuilt in that order (``build_shard_layout(order=…)``): a new bucket starts when the optimizer
   group changes or the bucket is full, so decay and no-decay parameters interleave in arrival order instead of
   every no-decay bucket waiting at the end;
3. the stage moves what already depends on the layout: parameter values (stages 1/2: parameters are views of the
   flat buffer), the fp32 gradient buffer's contents (earlier micro-steps under ``no_sync``/raw backward), fp32
   masters and optimizer states (only a checkpoint loaded before the first backward has any: see
   zero/relayout_state.py), and swaps the optimizer's tensors. This is before this run's first step;
4. the recorded gradients are absorbed and reduced in the new bucket order, so even this backward's staging stays
   bounded. From the second backward on, buckets launch while backward runs.

The price, once per run: in the recording backward nothing overlaps, and each parameter keeps autograd's own
gradient (compute dtype, as plain torch would) until autograd returns instead of handing it over at once. A run
resumed from a checkpoint re-lays out too (its optimizer states and fp32 masters are moved, which at stages 1/2
costs one all-gather per per-element tensor: zero/relayout_state.py).

Later order changes (data-dependent control flow) are logged once and not re-laid out: masters and optimizer
states follow the layout by then, and moving them every step would cost a gather. A streamed offload optimizer
(NVMe or CPU ``offload_optimizer``: chunks, store and per-bucket host gradient copies sized from the layout) is
rebuilt for the new layout, keeping a loaded checkpoint's states ([Note: re-layout with a streamed optimizer] in
zero/relayout_streamed.py). (ZeRO-sharded Lamb's per-parameter segments are refreshed in place.) Checkpoints are
by parameter name, so the layout never shows in them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardspeed.comm import Collectives
from shardspeed.topology import AxisGroup
from shardspeed.zero.layout import ShardLayout, build_shard_layout


@dataclass(frozen=True)
class LayoutPlanner:
    """Everything needed to rebuild a stage's layout in another order."""

    numels: tuple[int, ...]
    groups: tuple[int, ...]
    bucket_numel: int
    world: int

    def build(self, order: Sequence[int] | None = None) -> ShardLayout:
        return build_shard_layout(self.numels, self.groups, self.bucket_numel, self.world, order=order)


def complete_order(arrived: Sequence[int], layout: ShardLayout) -> list[int]:
    """``arrived`` followed by the parameters that got no gradient, in their current placement."""
    seen = set(arrived)
    return list(arrived) + [i for i in layout.placement if i not in seen]


def agree_on_order(
    arrived: Sequence[int], names: Sequence[str], layout: ShardLayout, collectives: Collectives, axis: AxisGroup
) -> list[int]:
    """Data-parallel rank 0's arrival order, after checking symmetrically that every rank packs the same
    parameters (collective over ``axis``: every rank must call it)."""
    mine = (tuple(names), complete_order(arrived, layout))
    everyone = collectives.all_gather_object(mine, axis)
    reference_names, order = everyone[0]  # type: ignore[misc]
    for rank, (rank_names, _) in enumerate(everyone):  # type: ignore[misc]
        if tuple(rank_names) != tuple(reference_names):
            differ = sorted(set(rank_names) ^ set(reference_names))[:5] or "same names, other order"
            raise RuntimeError(
                f"data-parallel rank {rank} packs other trainable parameters than rank 0 ({differ}); the gradient "
                "bucket layout must be identical on every rank"
            )
    return list(order)


def swap_optimizer_tensors(optimizer: torch.optim.Optimizer, stepped_groups: Callable[[], list[dict]]) -> None:
    """Point the optimizer's groups at the tensors of the new layout (their states were moved already)."""
    for group, new in zip(optimizer.param_groups, stepped_groups()):
        group["params"] = new["params"]
