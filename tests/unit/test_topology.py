from __future__ import annotations

import itertools

import pytest

from shardspeed.topology import AXES, MeshShape, axis_groups, coords_of, rank_of


@pytest.mark.parametrize("pipe,data,tensor", list(itertools.product([1, 2, 3], [1, 2, 4], [1, 2])))
def test_coords_round_trip_and_groups_partition_world(pipe: int, data: int, tensor: int) -> None:
    shape = MeshShape(pipe=pipe, data=data, tensor=tensor)
    for rank in range(shape.world_size):
        assert rank_of(coords_of(rank, shape), shape) == rank
    for axis in AXES:
        groups = axis_groups(shape, axis)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(shape.world_size))
        assert all(len(g) == shape.size(axis) for g in groups)
        for g in groups:  # members differ only along this axis
            others = [a for a in AXES if a != axis]
            assert len({tuple(coords_of(r, shape)[a] for a in others) for r in g}) == 1


def test_tensor_axis_is_innermost() -> None:
    shape = MeshShape(pipe=2, data=2, tensor=2)
    assert axis_groups(shape, "tensor")[0] == (0, 1)
    assert axis_groups(shape, "data")[0] == (0, 2)
    assert axis_groups(shape, "pipe")[0] == (0, 4)


def test_bad_shape() -> None:
    with pytest.raises(ValueError, match="'data' must be >= 1"):
        MeshShape(data=0)
    with pytest.raises(ValueError, match="outside a world"):
        coords_of(4, MeshShape(data=2))
