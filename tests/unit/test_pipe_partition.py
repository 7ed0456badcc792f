"""Pure pipeline partitioning (no process): balanced by parameters, by a class-name regex, uniform, with virtual
stages; every part non-empty; clear errors. And DeepSpeed's rank grids converted to shardspeed's mesh."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from shardspeed.pipe import LayerSpec, PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from shardspeed.pipe.partition import (
    chunk_bounds,
    layer_weights,
    owner_of,
    partition_balanced,
    partition_layers,
    partition_uniform,
)
from shardspeed.pipe.topology import mesh_of, to_topology
from shardspeed.topology import MeshShape, Topology, coords_of


def _bottleneck(weights: list[int], parts: list[int]) -> int:
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(parts))


def _best_bottleneck(weights: list[int], num_parts: int) -> int:
    """Brute force over every way to cut ``weights`` into ``num_parts`` non-empty runs."""
    n = len(weights)
    return min(_bottleneck(weights, [0, *cuts, n]) for cuts in itertools.combinations(range(1, n), num_parts - 1))


def test_uniform_spreads_the_remainder_over_the_first_parts() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(3, 3) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("weights", "num_parts", "expected"),
    [
        ([1, 1, 1, 1], 2, [0, 2, 4]),
        ([10, 1, 1, 1, 1, 10], 2, [0, 3, 6]),
        ([5, 5, 5, 100], 2, [0, 3, 4]),
        ([100, 1, 1, 1], 3, [0, 1, 3, 4]),  # the light layers split, not all lumped behind the heavy one
        ([0, 0, 0, 0, 5], 3, [0, 3, 4, 5]),  # parameter-free layers still leave every part one layer
        ([3, 0, 3, 0, 3, 0], 3, [0, 2, 4, 6]),
    ],
)
def test_balanced_examples(weights: list[int], num_parts: int, expected: list[int]) -> None:
    assert partition_balanced(weights, num_parts) == expected


def test_balanced_meets_the_optimal_bottleneck_with_no_empty_part() -> None:
    rng = torch.Generator().manual_seed(3)
    for trial in range(300):
        n = int(torch.randint(1, 9, (1,), generator=rng))
        num_parts = int(torch.randint(1, n + 1, (1,), generator=rng))
        weights = torch.randint(0, 20 if trial % 3 else 3, (n,), generator=rng).tolist()
        parts = partition_balanced(weights, num_parts)
        assert parts[0] == 0 and parts[-1] == n and len(parts) == num_parts + 1
        assert all(a < b for a, b in itertools.pairwise(parts)), (weights, num_parts, parts)
        assert _bottleneck(weights, parts) == _best_bottleneck(weights, num_parts), (weights, num_parts, parts)


def test_fewer_layers_than_parts_names_both() -> None:
    with pytest.raises(ValueError, match=r"3 layers cannot fill 4 pipeline parts"):
        partition_uniform(3, 4)
    with pytest.raises(ValueError, match=r"3 layers cannot fill 4 pipeline parts"):
        partition_layers([nn.Identity()] * 3, "parameters", num_stages=2, virtual_stages=2)


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)


def _specs() -> list[object]:
    return [
        LayerSpec(nn.Embedding, 100, 8),  # 800
        LayerSpec(Attention, 8),  # 216
        LayerSpec(MLPBlock, 8),  # 288
        LayerSpec(Attention, 8),
        LayerSpec(MLPBlock, 8),
        lambda x: x,
        LayerSpec(nn.LayerNorm, 8),  # 16
    ]


def test_parameter_weights_are_counted_without_building_or_drawing() -> None:
    frozen = nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)
    state = torch.get_rng_state()
    weights = layer_weights([*_specs(), frozen], "parameters")
    assert torch.equal(torch.get_rng_state(), state)  # counting on meta leaves the caller's RNG alone
    assert weights == [800, 216, 288, 216, 288, 0, 16, 4]  # the frozen weight is not counted
    assert partition_layers(_specs(), "parameters", 2) == [0, 2, 7]  # 1016 | 808 (800 | 1024 is worse)
    assert partition_layers(_specs(), "parameters", 3) == [0, 1, 4, 7]  # 800 | 720 | 304


def test_type_regex_balances_matching_layers_case_insensitively() -> None:
    assert layer_weights(_specs(), "type:attention") == [0, 1, 0, 1, 0, 0, 0]
    assert partition_layers(_specs(), "type:attention", 2) == [0, 3, 7]  # one Attention each
    assert partition_layers(_specs(), "type:Attention|MLP", 2) == [0, 3, 7]
    with pytest.raises(ValueError, match=r"'type:Conv' matches no layer .*'Attention'"):
        layer_weights(_specs(), "type:Conv")
    with pytest.raises(ValueError, match=r"invalid regex"):
        layer_weights(_specs(), "type:(")


def test_unknown_method_lists_the_methods() -> None:
    with pytest.raises(ValueError, match=r"'profile' is unknown: expected 'parameters', 'uniform' or 'type:REGEX'"):
        partition_layers(_specs(), "profile", 2)


def test_virtual_stages_interleave_parts_over_ranks() -> None:
    parts = partition_layers([nn.Identity()] * 10, "uniform", num_stages=2, virtual_stages=2)
    assert parts == [0, 3, 6, 8, 10]
    assert [chunk_bounds(parts, 2, stage, chunk) for stage in range(2) for chunk in range(2)] == [
        (0, 3),  # rank 0 chunk 0 = virtual stage 0
        (6, 8),  # rank 0 chunk 1 = virtual stage 2
        (3, 6),  # rank 1 chunk 0 = virtual stage 1
        (8, 10),  # rank 1 chunk 1 = virtual stage 3
    ]
    assert [owner_of(i, parts, 2) for i in (0, 3, 7, 9)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    with pytest.raises(ValueError, match=r"layer 10 outside the 10 layers"):
        owner_of(10, parts, 2)


# --- DeepSpeed's topologies ------------------------------------------------------------------------------------------


def test_process_topology_api() -> None:
    grid = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert grid.world_size() == 6
    assert grid.get_coord(rank=1) == (0, 1) and grid.get_coord(4).x == 1
    assert grid.get_rank(x=1, y=2) == 5
    assert grid.get_dim("y") == 3 and grid.get_dim("pipe") == 0
    assert grid.get_axis_list("x", 0) == [0, 1, 2] and grid.get_axis_list("y", 0) == [0, 3]
    assert grid.get_axis_comm_lists("x") == [[0, 3], [1, 4], [2, 5]] and grid.get_axis_comm_lists("z") == []
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert three.get_axis_names() == ["pipe", "data", "model"]
    assert three.filter_match(pipe=0, data=1) == [2, 3]
    assert three.get_rank_repr(rank=3) == "model_01"
    with pytest.raises(ValueError, match=r"every axis"):
        three.get_rank(pipe=0)


def test_deepspeed_grids_lay_ranks_out_like_ours() -> None:
    grid = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    shape = mesh_of(grid)
    assert shape == MeshShape(pipe=2, data=3, tensor=2)
    for rank in range(grid.world_size()):
        coord, ours = grid.get_coord(rank), coords_of(rank, shape)
        assert (coord.pipe, coord.data, coord.model) == (ours["pipe"], ours["data"], ours["tensor"])
    assert mesh_of(PipeDataParallelTopology(num_pp=4, num_dp=2)) == MeshShape(pipe=4, data=2)


def test_grids_we_cannot_lay_out_are_refused() -> None:
    with pytest.raises(ValueError, match=r"axes \['data', 'pipe'\] lay ranks out differently"):
        mesh_of(ProcessTopology(axes=["data", "pipe"], dims=[2, 2]))
    with pytest.raises(ValueError, match=r"\['expert'\] unknown"):
        mesh_of(ProcessTopology(axes=["pipe", "expert"], dims=[2, 2]))
    with pytest.raises(TypeError, match=r"shardspeed Topology or a ProcessTopology, got dict"):
        to_topology({"pipe": 2})


def test_a_topology_passes_through_and_a_grid_of_one_builds() -> None:
    ours = Topology.build(MeshShape())
    assert to_topology(ours) is ours
    built = to_topology(PipeDataParallelTopology(num_pp=1, num_dp=1))
    assert built.shape == MeshShape() and built.pipe.size == 1
