"""Tied copies made equal after ZeRO-3 materialized a model built under ``zero.Init``.

[Note: tied sync after materialization] ``PipelineModule`` broadcasts each tied module from its owner stage at
construction, and the engine again before the ZeRO stage copies the parameters (``sync_tied_weights``). Under
``zero.Init`` neither can move anything: the parameters are meta placeholders until stage 3 materializes them,
unit by unit, syncing each over the data and tensor axes only — never over a tie group. Seeding the copies alike
(``seed_layers``: the first occurrence's seed on every stage) is not enough on its own: without ``seed_layers``
each stage draws from the RNG as it finds it. So once materialized, each tied module is gathered on every rank of
its stage (``GatheredParameters`` with modifier data rank 0, so the exit broadcasts and writes the whole values
back into the shards and the fp32 masters), broadcast over the tie group from the owner, then released. Keys are
sorted (``tied_weights()``), so every rank meets the same collectives in the same order: the gathers are over the
stage's data axis (whose ranks hold the same keys), the broadcasts over each (key, data, tensor) tie group.
The gathered layout does not matter (whole parameters are broadcast), so the tied module may share a unit.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sync_tied_materialized"]


def sync_tied_materialized(module: Any, collectives: Any) -> None:
    """Broadcast every tied module of ``module`` (a ``PipelineModule`` whose ZeRO-3 engine is built) from its
    owner stage, through whole gathered parameters (collective: every rank, same order)."""
    from shardspeed.zero.stage3.gathered import GatheredParameters

    for tie in module.tied_weights():
        if tie.axis.group is None:  # one stage holds the key: nothing to agree with
            continue
        params = [module.get_parameter(name) for name in module.synced_names(tie)]
        with GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p in params:
                collectives.broadcast(p.data, tie.axis, 0, tag=f"pipe.tied.{tie.key}")
