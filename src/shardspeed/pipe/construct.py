"""What ``PipelineModule``'s constructor checks and agrees on before it builds anything world-collective: its
arguments, the topology it runs on, and — after each stage built its own layers — that every rank got that far
with the same plan ([Note: agreed construction])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from shardspeed.pipe.topology import to_topology
from shardspeed.topology import MeshShape, Topology

__all__ = ["agree_construction", "check_arguments", "resolve_topology"]


def check_arguments(
    num_stages: int | None,
    topology: Any,
    interval: int,
    checkpointable_layers: Sequence[str] | None,
    virtual_stages: int,
) -> None:
    if num_stages is None and topology is None:
        raise ValueError("PipelineModule needs num_stages or topology")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages={num_stages!r}: expected a positive integer")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r}: expected a positive integer")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"activation_checkpoint_interval={interval!r}: expected an integer >= 0")
    if checkpointable_layers is not None and (
        isinstance(checkpointable_layers, str) or not all(isinstance(n, str) for n in checkpointable_layers)
    ):
        raise TypeError(f"checkpointable_layers={checkpointable_layers!r}: expected a list of class names")


def resolve_topology(num_stages: int | None, topology: Any) -> Topology:
    """The given topology (converted from DeepSpeed's grid), else pipe=num_stages × data=rest. Joins the default
    process group first if nobody has."""
    if not dist.is_initialized():
        from shardspeed.distributed import init_distributed

        init_distributed(verbose=False)
    if topology is not None:
        resolved = to_topology(topology)
        if num_stages is not None and num_stages != resolved.pipe.size:
            raise ValueError(f"num_stages={num_stages} disagrees with the topology's {resolved.pipe.size} pipe stages")
        return resolved
    assert num_stages is not None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide the world size {world}")
    return Topology.build(MeshShape(pipe=num_stages, data=world // num_stages))


def agree_construction(topology: Topology, plan: Any, failure: Exception | None) -> None:
    """[Note: agreed construction] Building a layer happens on its stage only, so a layer that fails to build
    raises on one stage while the others go on to the world-collective tie-group creation and wait there forever.
    One all-gather over the world first: a build failure anywhere is the same error on every rank (naming the
    stage, rank and error), and a partition that differs between ranks (a spec whose size is not deterministic) is
    refused before any tie group pairs the wrong layers."""
    world = topology.world
    if world.size == 1:
        if failure is not None:
            raise failure
        return
    from shardspeed.comm.collectives import Collectives
    from shardspeed.faults.errors import mark_agreed

    mine = (topology.pipe.rank, plan, None if failure is None else (type(failure).__name__, str(failure)))
    everyone: list[Any] = Collectives().all_gather_object(mine, world)
    for index, (stage, _, error) in enumerate(everyone):
        if error is not None:
            kind = {"TypeError": TypeError, "ValueError": ValueError}.get(error[0], RuntimeError)
            agreed = kind(
                f"pipeline stage {stage} (rank {world.ranks[index]}) failed to build its layers: {error[0]}: {error[1]}"
            )
            raise mark_agreed(agreed) from failure
    plans = [p for _, p, _ in everyone]
    if any(p != plans[0] for p in plans):
        index = next(i for i, p in enumerate(plans) if p != plans[0])
        raise mark_agreed(
            ValueError(
                f"the pipeline partition differs between ranks (layer specs must build alike everywhere): rank "
                f"{world.ranks[0]} has parts/ties {plans[0]}, rank {world.ranks[index]} {plans[index]}"
            )
        )
