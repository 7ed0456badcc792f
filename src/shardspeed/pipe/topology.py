"""DeepSpeed's pipeline topologies (``deepspeed.runtime.pipe.topology``), as pure rank grids convertible to ours.

``ProcessTopology(axes, dims)`` maps each global rank to a coordinate, row-major over ``axes`` (the last axis is
the innermost). ``PipeDataParallelTopology(num_pp, num_dp)`` is axes (pipe, data);
``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` is axes (pipe, data, model). Both lay ranks out exactly
as ``shardspeed.topology`` does (``global = (pipe·D + data)·T + tensor``, DeepSpeed's "model" being our tensor
axis), so ``to_topology`` turns one into a ``Topology`` with ``Topology.build``. A grid listing the axes in
another order lays the ranks out differently and is refused by name rather than silently re-laid-out.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from itertools import product
from typing import Any

from shardspeed.topology import MeshShape, Topology

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "to_topology",
]

# DeepSpeed's axis name → ours, in the one order whose row-major layout is ours.
_OUR_AXES = {"pipe": "pipe", "data": "data", "model": "tensor", "tensor": "tensor"}
_ORDER = ("pipe", "data", "tensor")


class ProcessTopology:
    """A rank grid over named axes (DeepSpeed's API: ``get_dim``, ``get_coord``, ``get_rank``, ``world_size``,
    ``get_axis_names``, ``get_axis_list``, ``filter_match``, ``get_axis_comm_lists``, ``get_rank_repr``)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axes {list(axes)} and dims {list(dims)} must pair up, no repeats")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {list(dims)}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {
            self.ProcessCoord(*coord): rank for rank, coord in enumerate(product(*(range(d) for d in self.dims)))
        }

    def get_rank(self, **coord_kwargs: int) -> int:
        """The global rank at the given coordinate (every axis named)."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs every axis {self.axes}, got {sorted(coord_kwargs)}")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a namedtuple over the axes) of global ``rank``."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not in a world of {self.world_size()}")
        coord, rest = [], rank
        for dim in reversed(self.dims):
            rest, index = divmod(rest, dim)
            coord.append(index)
        return self.ProcessCoord(*reversed(coord))

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 for an axis this grid does not have (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def world_size(self) -> int:
        return len(self.mapping)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Global ranks whose ``axis`` coordinate is ``idx``."""
        return self.filter_match(**{axis: idx})

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Global ranks whose coordinates match every given axis value, ascending."""
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis`` ([] for an axis this grid lacks)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def get_rank_repr(
        self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ) -> str:
        """``"model_01"``-style name of ``rank`` over the axes not omitted (DeepSpeed's checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes
        )

    def __str__(self) -> str:
        return f"ProcessTopology(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline × data parallelism (DeepSpeed's hybrid): axes (pipe, data)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline × data × model (tensor) parallelism: axes (pipe, data, model), model innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def mesh_of(topology: ProcessTopology) -> MeshShape:
    """Our ``MeshShape`` for a DeepSpeed grid; ValueError for an axis we lack or an order laying ranks out
    differently (pure)."""
    unknown = [a for a in topology.axes if a not in _OUR_AXES]
    if unknown:
        raise ValueError(f"topology axes {topology.axes}: {unknown} unknown (expected pipe, data, model)")
    ours = [_OUR_AXES[a] for a in topology.axes]
    present = [a for a in _ORDER if a in ours]
    if ours != present:
        raise ValueError(
            f"topology axes {topology.axes} lay ranks out differently from shardspeed's (pipe, data, model "
            f"with model innermost); list them in that order"
        )
    sizes = {_OUR_AXES[a]: d for a, d in zip(topology.axes, topology.dims, strict=True)}
    return MeshShape(pipe=sizes.get("pipe", 1), data=sizes.get("data", 1), tensor=sizes.get("tensor", 1))


def to_topology(topology: Any) -> Topology:
    """A shardspeed ``Topology`` as is; a DeepSpeed-style grid built into one (world-collective: group creation)."""
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, ProcessTopology):
        return Topology.build(mesh_of(topology))
    raise TypeError(f"topology must be a shardspeed Topology or a ProcessTopology, got {type(topology).__name__}")
