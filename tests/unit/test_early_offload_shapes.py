"""``unit_shapes``: what the parameter store is opened with before any unit has values ([Note: offload during
construction] in zero/stage3/early_offload.py): sizes from the plan and the (meta) parameters, persistent unit
left out, the same shard sizes ``ParamUnit`` gives once the values exist."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardspeed.zero.stage3.early_offload import unit_shapes
from shardspeed.zero.stage3.plan import PERSISTENT, plan_units


def test_shapes_from_meta_parameters_match_the_plan() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 3, bias=False), nn.LayerNorm(3))
    plan = plan_units(model, 4, ())  # parameters of at most 4 elements (biases, the norm's) are persistent
    ordered = [list(spec.param_names) for spec in plan.units]
    named = dict(model.named_parameters())
    shapes = unit_shapes(plan, ordered, named, 4, torch.device("cpu"))
    expected = [(i, spec.name) for i, spec in enumerate(plan.units) if spec.name != PERSISTENT]
    assert [(s.index, s.name) for s in shapes] == expected
    assert plan.persistent is not None and len(shapes) == len(plan.units) - 1
    assert [(s.names, s.numel, s.shard_numel) for s in shapes] == [
        (("0.weight",), 15, 4),  # 15 elements padded to 16 over 4 ranks
        (("1.weight",), 9, 3),  # 9 padded to 12
    ]
    assert all(s.dtype == torch.float32 and s.device == torch.device("cpu") for s in shapes)


def test_device_defaults_to_the_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = plan_units(model, 0, ())
    ordered = [list(spec.param_names) for spec in plan.units]
    shapes = unit_shapes(plan, ordered, dict(model.named_parameters()), 3, None)
    assert [s.shard_numel for s in shapes] == [7, 7]  # 20 elements padded to 21 over 3 ranks
    assert {s.device for s in shapes} == {torch.device("cpu")}
