"""Data × tensor × pipeline process topology.

The mesh math (which global ranks share an axis) is pure and tested without processes; `Topology.build` turns it
into process groups once, and the resulting object is passed down explicitly — there is no module-level group state.

[Note: axes and scopes] The *axes* are the mesh's dimensions (pipe, data, tensor; sequence and expert would be
further axes). A *scope* is a set of axes a role communicates over, and each has its own group, built once:
- ``data``: batch slicing, gradient reduction and ZeRO sharding (replicas of the same model slice);
- ``tensor``: tensor-parallel layers (Megatron's f/g), sequence-parallel gathers, partitioned activations;
- ``model`` = pipe × tensor: ranks that hold *different* pieces of one model replica; a sum over the model
  (gradient norm, Lamb's norms of TP-sliced parameters) is a sum over this scope, counting each
  tensor-replicated parameter on one tensor rank only (``params/spec.py``);
- ``world``: decisions every rank must take alike (overflow, step checks, checkpoint commit).
A Topology is also a Megatron-style ``mpu`` (``get_data_parallel_group()``, ``get_tensor_model_parallel_rank()``,
…), so a model built on it and ``initialize(mpu=topology)`` agree on the groups.

Rank layout: pipeline is the outermost axis, tensor the innermost (ranks of one tensor-parallel group are
adjacent, so on a GPU cluster they land on one node), data in between:
    global_rank = (pipe_index * data + data_index) * tensor + tensor_index
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

Axis = Literal["pipe", "data", "tensor"]
AXES: tuple[Axis, ...] = ("pipe", "data", "tensor")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the three parallel axes; their product is the world size."""

    pipe: int = 1
    data: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh axis '{axis}' must be >= 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.pipe * self.data * self.tensor

    def size(self, axis: Axis) -> int:
        return getattr(self, axis)


def coords_of(rank: int, shape: MeshShape) -> dict[Axis, int]:
    """Index of global ``rank`` along each axis."""
    if not 0 <= rank < shape.world_size:
        raise ValueError(f"rank {rank} outside a world of {shape.world_size}")
    tensor_index = rank % shape.tensor
    data_index = (rank // shape.tensor) % shape.data
    pipe_index = rank // (shape.tensor * shape.data)
    return {"pipe": pipe_index, "data": data_index, "tensor": tensor_index}


def rank_of(coords: dict[Axis, int], shape: MeshShape) -> int:
    """Global rank at the given axis indices (inverse of `coords_of`)."""
    return (coords["pipe"] * shape.data + coords["data"]) * shape.tensor + coords["tensor"]


def axis_groups(shape: MeshShape, axis: Axis) -> list[tuple[int, ...]]:
    """Every group of global ranks that differ only along ``axis``, in a fixed order (all ranks agree on it)."""
    return scope_groups(shape, (axis,))


def scope_groups(shape: MeshShape, axes: tuple[Axis, ...]) -> list[tuple[int, ...]]:
    """Every group of global ranks that differ only along ``axes`` (members in ascending rank order), in a fixed
    order all ranks agree on."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(shape.world_size):
        coords = coords_of(rank, shape)
        key = tuple(coords[a] for a in AXES if a not in axes)
        groups.setdefault(key, []).append(rank)
    return [tuple(members) for _, members in sorted(groups.items())]


SCOPES: dict[str, tuple[Axis, ...]] = {
    "pipe": ("pipe",),
    "data": ("data",),
    "tensor": ("tensor",),
    "model": ("pipe", "tensor"),
    "world": AXES,
}
"""Every group a Topology builds ([Note: axes and scopes]), in build order (every rank creates them alike)."""


@dataclass(frozen=True)
class AxisGroup:
    """One rank's view of one mesh axis: its process group, the member ranks, and its index among them.

    ``group`` is None exactly when the axis has size 1 (no communication is ever needed). Collectives take an
    AxisGroup rather than a raw ProcessGroup so a size-1 axis can never be mistaken for "the default group".
    """

    name: str
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int  # this process's index along the axis (not its global rank)

    @property
    def size(self) -> int:
        return len(self.ranks)


class Topology:
    """The process groups of this rank for each mesh axis and scope. Build once per job; pass it down."""

    def __init__(self, shape: MeshShape, global_rank: int, axes: dict[str, AxisGroup]) -> None:
        self.shape = shape
        self.global_rank = global_rank
        self.pipe = axes["pipe"]
        self.data = axes["data"]
        self.tensor = axes["tensor"]
        solo = AxisGroup("model", None, (global_rank,), 0)
        self.model: AxisGroup = axes.get("model", solo)
        """pipe × tensor: the ranks holding different pieces of this rank's model replica."""
        self.world: AxisGroup = axes.get("world", AxisGroup("world", None, (global_rank,), 0))
        """Every rank."""

    @classmethod
    def build(cls, shape: MeshShape | None = None) -> Topology:
        """Create the groups for ``shape`` (default: all ranks on the data axis). Every rank must call this."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        shape = shape or MeshShape(data=world_size)
        if shape.world_size != world_size:
            raise ValueError(
                f"mesh pipe={shape.pipe} × data={shape.data} × tensor={shape.tensor} = {shape.world_size} "
                f"does not match the world size {world_size}"
            )
        mine = coords_of(rank, shape)
        axes: dict[str, AxisGroup] = {}
        for scope, scope_axes in SCOPES.items():
            groups = scope_groups(shape, scope_axes)
            own = next(g for g in groups if rank in g)
            if len(own) == 1:
                pg = None
            elif len(own) == world_size:
                pg = dist.group.WORLD
            else:
                # new_group is collective over the whole world: every rank creates every group, same order.
                created = [dist.new_group(list(g)) for g in groups]
                pg = created[groups.index(own)]
            axes[scope] = AxisGroup(scope, pg, own, own.index(rank))
        assert all(axes[a].rank == mine[a] for a in AXES)
        return cls(shape, rank, axes)

    @classmethod
    def from_data_group(cls, group: dist.ProcessGroup, ranks: tuple[int, ...], rank_in_group: int) -> Topology:
        """A topology whose data axis is a caller-provided group (e.g. a Megatron-style ``mpu``'s)."""
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        data = AxisGroup("data", group if len(ranks) > 1 else None, ranks, rank_in_group)
        solo = (global_rank,)
        return cls(
            MeshShape(data=len(ranks)),
            global_rank,
            {
                "data": data,
                "pipe": AxisGroup("pipe", None, solo, 0),
                "tensor": AxisGroup("tensor", None, solo, 0),
            },
        )

    # DeepSpeed-familiar names, used by the demo and by users' code.
    @property
    def dp_rank(self) -> int:
        return self.data.rank

    @property
    def dp_world_size(self) -> int:
        return self.data.size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.data.group

    @property
    def tp_rank(self) -> int:
        return self.tensor.rank

    @property
    def tp_world_size(self) -> int:
        return self.tensor.size

    # --- the Megatron ``mpu`` interface: a Topology can be passed as ``initialize(mpu=...)`` ----------------------
    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.data.group

    def get_data_parallel_rank(self) -> int:
        return self.data.rank

    def get_data_parallel_world_size(self) -> int:
        return self.data.size

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.tensor.group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tensor.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor.size

    # Megatron's older names: "model parallel" meant the tensor axis.
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.pipe.group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pipe.rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipe.size
