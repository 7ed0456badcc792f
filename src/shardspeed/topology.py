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
from typing import Any, Literal

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

    def __init__(
        self,
        shape: MeshShape,
        global_rank: int,
        axes: dict[str, AxisGroup],
        layout: tuple[int, ...] | None = None,
    ) -> None:
        self.shape = shape
        self.global_rank = global_rank
        self.layout: tuple[int, ...] = layout or tuple(range(shape.world_size))
        """Global ranks in (pipe, data, tensor) row-major order: ``layout[rank_of(coords)]`` is the rank at those
        coordinates. The identity for ``build``; an mpu may lay its ranks out differently (``from_mpu``)."""
        self._device_mesh: Any = None
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
            axes[scope] = _own_group(scope, groups, rank, world_size)
        assert all(axes[a].rank == mine[a] for a in AXES)
        return cls(shape, rank, axes)

    @classmethod
    def from_mpu(cls, mpu: Any) -> Topology:
        """The topology of a Megatron-style ``mpu``: its data, tensor and pipeline groups are used as they are
        (a shardspeed ``Topology`` passed as mpu is returned unchanged). Every rank must call this.

        Each rank's (pipe, data, tensor) indices and group members are all-gathered over the world and checked to
        form one full grid (``grid_from_mpu_records``: the same ``MeshError`` on every rank otherwise); the derived
        scopes (``model``, ``world``) are then created, in the same order on every rank.
        """
        if isinstance(mpu, Topology):
            return mpu
        from shardspeed.mesh import MpuRecord, grid_from_mpu_records

        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        record = _mpu_record(mpu)
        records: list[Any] = [None] * world_size
        if world_size > 1:
            dist.all_gather_object(records, record)
        else:
            records = [record]
        shape, layout = grid_from_mpu_records(records)  # raises alike on every rank: same gathered list
        assert isinstance(record, MpuRecord)  # an error text on any rank raised above, on every rank
        getters = _MPU_GROUP_GETTERS
        axes: dict[str, AxisGroup] = {}
        for axis in AXES:
            ranks = record.ranks[AXES.index(axis)]
            group = _call_first(mpu, getters[axis]) if len(ranks) > 1 else None
            axes[axis] = AxisGroup(axis, group, ranks, record.coords[AXES.index(axis)])
        # model = pipe × tensor: the ranks sharing this rank's data index, built in the same order everywhere.
        by_data: dict[int, list[int]] = {}
        for r, rec in enumerate(records):
            by_data.setdefault(rec.coords[1], []).append(r)
        model_groups = [tuple(members) for _, members in sorted(by_data.items())]
        axes["model"] = _own_group("model", model_groups, rank, world_size)
        world = tuple(range(world_size))
        axes["world"] = AxisGroup("world", dist.group.WORLD if world_size > 1 else None, world, rank)
        return cls(shape, rank, axes, layout)

    def device_mesh(self, device_type: str | None = None) -> Any:
        """A torch ``DeviceMesh`` with dims ("pipe", "data", "tensor") over this topology's own process groups,
        for DTensor code (``mesh["tensor"].get_group()`` is our tensor group). Collective on first call (a size-1
        axis needs a one-rank group, created world-wide); cached after."""
        if self._device_mesh is not None:
            return self._device_mesh
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise RuntimeError("Topology.device_mesh() needs torch.distributed to be initialized")
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        singleton: dist.ProcessGroup | None = None
        groups: list[dist.ProcessGroup] = []
        for axis in (self.pipe, self.data, self.tensor):
            if axis.group is None:
                if singleton is None:  # new_group is world-collective: every rank creates every one-rank group
                    world = dist.get_world_size()
                    singles = [dist.new_group([r]) for r in range(world)] if world > 1 else [dist.group.WORLD]
                    singleton = singles[self.global_rank if world > 1 else 0]
                groups.append(singleton)
            else:
                groups.append(axis.group)
        shape = self.shape
        mesh = torch.tensor(self.layout, dtype=torch.int64).view(shape.pipe, shape.data, shape.tensor)
        self._device_mesh = DeviceMesh.from_group(
            groups, device_type, mesh=mesh, mesh_dim_names=("pipe", "data", "tensor")
        )
        return self._device_mesh

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


# --- a foreign mpu's layout, checked as one grid ---------------------------------------------------------------------
_MPU_GROUP_GETTERS: dict[str, tuple[str, ...]] = {
    "pipe": ("get_pipeline_model_parallel_group",),
    "data": ("get_data_parallel_group",),
    "tensor": ("get_tensor_model_parallel_group", "get_model_parallel_group"),
}
_MPU_RANK_GETTERS: dict[str, tuple[str, ...]] = {
    "pipe": ("get_pipeline_model_parallel_rank",),
    "data": ("get_data_parallel_rank",),
    "tensor": ("get_tensor_model_parallel_rank", "get_model_parallel_rank"),
}


def _call_first(mpu: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        getter = getattr(mpu, name, None)
        if getter is not None:
            return getter()
    return None


def _mpu_record(mpu: Any) -> Any:
    """This rank's record, or the text of what went wrong reading the mpu (gathered like a record, so a rank whose
    mpu is broken makes every rank raise instead of leaving its peers in the all-gather)."""
    from shardspeed.mesh import MpuRecord

    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        coords, ranks = [], []
        for axis in AXES:
            group = _call_first(mpu, _MPU_GROUP_GETTERS[axis])
            if group is None:  # an mpu without this axis (no pipeline): a size-1 axis
                members: tuple[int, ...] = (rank,)
                index = 0
            else:
                members = tuple(dist.get_process_group_ranks(group))
                index = int(_call_first(mpu, _MPU_RANK_GETTERS[axis]) or 0)
                if not 0 <= index < len(members) or members[index] != rank:
                    return (
                        f"its mpu says it is {axis} rank {index}, but global rank {rank} is at index "
                        f"{members.index(rank) if rank in members else 'none'} of that group's ranks {list(members)}"
                    )
            coords.append(index)
            ranks.append(members)
        return MpuRecord(tuple(coords), tuple(ranks))  # type: ignore[arg-type]
    except Exception as exc:
        return f"reading its mpu failed: {type(exc).__name__}: {exc}"


def _own_group(name: str, groups: list[tuple[int, ...]], rank: int, world_size: int) -> AxisGroup:
    """This rank's member of ``groups`` (a partition of the world, listed in the same order on every rank) as an
    AxisGroup: no process group for a group of one, the default group for the whole world, else a new group —
    ``new_group`` is collective over the world, so every rank creates every group, in the same order."""
    own = next(g for g in groups if rank in g)
    if len(own) == 1:
        pg = None
    elif len(own) == world_size:
        pg = dist.group.WORLD
    else:
        created = [dist.new_group(list(g)) for g in groups]
        pg = created[groups.index(own)]
    return AxisGroup(name, pg, own, own.index(rank))
