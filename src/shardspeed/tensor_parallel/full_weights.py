"""The dense model's weights out of (and into) a tensor-parallel engine: the collective half of
[Note: full weights under tensor parallelism] (``params/assemble.py``).

Every tensor rank takes part in each gather, one parameter at a time and in state-dict order (the same on every
tensor rank: the structure check at construction compared the ranks' models), so memory stays bounded by one
global tensor plus the ranks' slices of it. All ranks get the result; only the writer uses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardspeed.params.assemble import assemble_global, max_local_shape
from shardspeed.params.spec import ParamSpec


def tensor_split(engine: Any) -> bool:
    """Whether the engine's state dict differs from the dense model's (tensor axis > 1 and a partitioned spec).
    Decided from the topology and the agreed specs, so every rank takes the same branch."""
    specs = getattr(engine, "param_specs", None)
    return engine.topology.tensor.size > 1 and specs is not None and specs.any_partitioned


def specs_by_state_name(engine: Any) -> dict[str, tuple[str, ParamSpec]]:
    """State-dict name (every name of a tied parameter) → (canonical name, spec) of partitioned parameters."""
    module, specs = engine.module, engine.param_specs
    canonical = {id(p): name for name, p in module.named_parameters()}
    out: dict[str, tuple[str, ParamSpec]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        spec = specs.by_name(canonical[id(p)])
        if spec is not None and spec.partitioned:
            out[name] = (canonical[id(p)], spec)
    return out


def gather_global(engine: Any, spec: ParamSpec, local: torch.Tensor) -> torch.Tensor:
    """The global tensor of ``spec`` from every tensor rank's ``local`` one (collective over the tensor axis): each
    rank's tensor padded to the largest local shape, one equal-sized all-gather, boxes placed."""
    axis = engine.topology.tensor
    shape = max_local_shape(spec, axis.size)
    padded = local.new_zeros(shape)
    padded[tuple(slice(0, n) for n in local.shape)] = local.detach()
    everyone = local.new_empty((axis.size, *shape))
    engine.collectives.all_gather(everyone.view(-1), padded.view(-1), axis, tag="tp.full_weights")
    return assemble_global(spec, list(everyone.unbind(0)))


def globalize(engine: Any, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``state`` (model names → local tensors) with every partitioned tensor replaced by its global one; tied
    names keep sharing one tensor (gathered once). Lazy, one gather per parameter (collective: all tensor ranks
    iterate it to the end)."""
    specs = specs_by_state_name(engine)
    done: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name not in specs:
            yield name, value
            continue
        canonical, spec = specs[name]
        if canonical not in done:
            done[canonical] = gather_global(engine, spec, value)
        yield name, done[canonical]


def global_shapes(engine: Any, shapes: Mapping[str, torch.Size]) -> dict[str, torch.Size]:
    """The dense model's shapes: ``shapes`` (local, by state-dict name) with partitioned ones made global."""
    specs = specs_by_state_name(engine) if tensor_split(engine) else {}
    return {n: torch.Size(specs[n][1].global_shape) if n in specs else s for n, s in shapes.items()}


def local_values(engine: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This tensor rank's slices of a dense state dict (``ParamSpec.slice_global``; vocabulary padding rows zero);
    other entries as they are. Shapes must have been checked against ``global_shapes`` first."""
    if not tensor_split(engine):
        return dict(state)
    specs, registry = specs_by_state_name(engine), engine.param_specs
    return {
        n: specs[n][1].slice_global(v, registry.tp_rank, registry.tp_size) if n in specs else v
        for n, v in state.items()
    }
