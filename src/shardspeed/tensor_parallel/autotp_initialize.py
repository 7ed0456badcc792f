"""AutoTP inside ``initialize``: slice the model once the mesh and the config are known, and keep the user's
optimizer / ``model_parameters`` pointing at the parameters that will train.

[Note: parameters replaced by AutoTP] ``apply_tensor_parallel`` replaces each sliced ``nn.Linear`` / ``Conv1D``
by a parallel layer with *new* ``nn.Parameter`` objects (this rank's slice), under the same names. A script written
for DeepSpeed passes ``model.parameters()`` (often already materialized as a list, or as parameter-group dicts) or
an optimizer built on the dense model *before* initialize — DeepSpeed's AutoTP has the same problem and slices in
place for that reason. Here the references are remapped by name: every dense parameter that was replaced is swapped
for the parameter now registered under its name, in the group lists and in a client optimizer's ``param_groups``.
An optimizer that already holds state for a replaced parameter cannot be remapped (its moments have the dense
shape): that is a clear error, before anything collective.

A model built under ``zero.Init`` (meta parameters) cannot be sliced. Whether it was is agreed over the world first
(one small all-gather, only with AutoTP on): a script may build under zero.Init on some ranks only, and a refusal
raised on those alone would leave the others waiting in the engine's first collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardspeed.comm import Collectives
from shardspeed.faults.errors import mark_agreed
from shardspeed.tensor_parallel.autotp import apply_tensor_parallel, meta_refusal
from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.topology import Topology


def slice_for_autotp(
    model: nn.Module,
    topology: Topology,
    settings: Any,
    optimizer: Any,
    model_parameters: Iterable[Any] | None,
    collectives: Collectives | None = None,
) -> Iterable[Any] | None:
    """Apply AutoTP (``tensor_parallel.autotp_size`` > 1) to ``model`` in place; returns ``model_parameters``
    with replaced parameters swapped for the sliced ones (a client optimizer's groups are updated in place).
    ``collectives``: for the meta-device agreement (initialize passes one on its failure board); collective over the
    world when AutoTP is on."""
    if not settings.enabled or topology.tensor.size == 1:
        return model_parameters
    _refuse_meta_agreed(model, topology, collectives or Collectives())
    before = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    tp = TensorParallel.from_topology(topology, sequence_parallel=bool(settings.sequence_parallel))
    apply_tensor_parallel(model, tp, settings)
    after = dict(model.named_parameters(remove_duplicate=False))
    current = {id(p) for p in after.values()}
    swap = {old: after[name] for old, name in before.items() if old not in current and name in after}
    if isinstance(optimizer, torch.optim.Optimizer):
        stale = [before[id(p)] for p in optimizer.state if id(p) in swap]
        if stale:
            raise ValueError(
                f"the optimizer passed to initialize() already holds state for {', '.join(stale[:3])}, which "
                "tensor_parallel.autotp_size slices into new parameters: build the optimizer without stepping it, or "
                "pass model_parameters and an optimizer config instead"
            )
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
    if model_parameters is None:
        return None
    items = list(model_parameters)  # a generator over the dense model is consumed here, once
    if items and all(isinstance(g, dict) for g in items):
        out = []
        for g in items:
            params = g["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            out.append({**g, "params": [swap.get(id(p), p) for p in params]})
        return out
    return [swap.get(id(p), p) if isinstance(p, torch.Tensor) else p for p in items]


def _refuse_meta_agreed(model: nn.Module, topology: Topology, collectives: Collectives) -> None:
    """A model on the meta device (zero.Init) on any rank: the same ``NotImplementedError`` on every rank, naming
    the ranks. Collective over the world."""
    mine = meta_refusal(model)
    everyone = collectives.all_gather_object(mine, topology.world) if topology.world.size > 1 else [mine]
    refusing = [(topology.world.ranks[i], why) for i, why in enumerate(everyone) if why is not None]
    if refusing:
        ranks = ", ".join(str(rank) for rank, _ in refusing)
        raise mark_agreed(NotImplementedError(f"on rank(s) {ranks}: {refusing[0][1]}"))
