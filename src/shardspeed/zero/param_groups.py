"""Parameter groups: from what the user passed (parameters, group dicts, an optimizer) to a packing order.

Every trainable parameter is packed into the flat buffers, grouped by optimizer parameter group (buckets never
mix groups, so each optimizer group steps whole bucket shards) and, inside a group, in reverse registration order
— a first guess at the order backward produces gradients. It is only the initial layout: the first backward's
real arrival order replaces it ([Note: arrival-order layout] in zero/arrival_order.py), groups interleaved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PackedParams:
    params: list[torch.nn.Parameter]
    names: list[str]
    groups: list[int]  # optimizer group index per packed parameter; len(user groups) = "in no group"


def normalize_groups(model_parameters: Iterable[Any] | None, module: torch.nn.Module) -> list[dict[str, Any]]:
    """The user's parameters as a list of group dicts (hyperparameters kept), checked against the module."""
    if model_parameters is None:
        items: list[Any] = [p for p in module.parameters()]
    else:
        items = list(model_parameters)
    if items and all(isinstance(g, dict) for g in items):
        groups = [dict(g) for g in items]
        for g in groups:
            if "params" not in g:
                raise ValueError("a parameter-group dict passed as model_parameters has no 'params' entry")
            g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
    elif any(isinstance(g, dict) for g in items):
        raise ValueError("model_parameters mixes parameter-group dicts and bare tensors; use one or the other")
    else:
        groups = [{"params": items}]
    owned = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    for index, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"parameter group {index} holds a tensor of shape {tuple(p.shape)} that is not a parameter of "
                    "the model passed to initialize(); its gradient would never be reduced"
                )
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in more than one parameter group")
            seen.add(id(p))
    return groups


def pack_order(module: torch.nn.Module, groups: list[dict[str, Any]]) -> PackedParams:
    """Trainable parameters (tied ones once) ordered by (group, reverse registration)."""
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    order = sorted(range(len(named)), key=lambda i: (group_of.get(id(named[i][1]), len(groups)), -i))
    return PackedParams(
        params=[named[i][1] for i in order],
        names=[named[i][0] for i in order],
        groups=[group_of.get(id(named[i][1]), len(groups)) for i in order],
    )
