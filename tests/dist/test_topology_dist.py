"""The topology's process groups at world 4 (TP=2 × DP=2): built from a MeshShape, from a Megatron-style mpu
(default and non-default layouts; a layout that is not a grid is one error on every rank), and as a torch
DeviceMesh over the same groups (a DTensor all-reduce over its tensor dim)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness import error_of
from shardspeed.topology import MeshShape, Topology


class MegatronStyleMpu:
    """The minimal Megatron ``mpu`` (what ``initialize(mpu=)`` reads): groups created in the same order on every
    rank from lists of tensor groups and data groups; no pipeline methods at all."""

    def __init__(self, tensor_groups: list[list[int]], data_groups: list[list[int]]) -> None:
        rank = dist.get_rank()
        self._tensor = self._data = None
        self._tensor_ranks: list[int] = []
        self._data_ranks: list[int] = []
        for ranks in tensor_groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                self._tensor, self._tensor_ranks = group, ranks
        for ranks in data_groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                self._data, self._data_ranks = group, ranks

    def get_data_parallel_group(self) -> Any:
        return self._data

    def get_data_parallel_rank(self) -> int:
        return self._data_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self) -> int:
        return len(self._data_ranks)

    def get_tensor_model_parallel_group(self) -> Any:
        return self._tensor

    def get_tensor_model_parallel_rank(self) -> int:
        return self._tensor_ranks.index(dist.get_rank())

    def get_tensor_model_parallel_world_size(self) -> int:
        return len(self._tensor_ranks)


def _summary(topology: Topology) -> dict:
    """Each scope's ranks and this rank's index, plus an all-reduce of the global rank over each scope's group."""
    out: dict[str, Any] = {"shape": topology.shape, "layout": topology.layout}
    for name in ("pipe", "data", "tensor", "model", "world"):
        axis = getattr(topology, name)
        value = torch.tensor([float(topology.global_rank)])
        if axis.group is not None:
            dist.all_reduce(value, group=axis.group)
        out[name] = (axis.ranks, axis.rank, value.item())
    return out


def _built(rank: int, world: int) -> dict:
    return _summary(Topology.build(MeshShape(data=2, tensor=2)))


def test_build_tp2_dp2_groups(dist_run) -> None:
    results = dist_run(_built, 4)
    assert results[0]["tensor"] == ((0, 1), 0, 1.0)
    assert results[3]["tensor"] == ((2, 3), 1, 5.0)
    assert results[1]["data"] == ((1, 3), 0, 4.0)
    assert results[2]["model"] == ((2, 3), 0, 5.0)  # pipe × tensor: ranks sharing the data index
    assert all(r["world"][0] == (0, 1, 2, 3) and r["world"][2] == 6.0 for r in results)
    assert all(r["pipe"] == ((rank,), 0, float(rank)) for rank, r in enumerate(results))


def _from_mpu(rank: int, world: int, tensor_groups: list, data_groups: list) -> dict:
    topology = Topology.from_mpu(MegatronStyleMpu(tensor_groups, data_groups))
    assert Topology.from_mpu(topology) is topology  # a shardspeed Topology passed as mpu is used as is
    return _summary(topology)


def test_from_mpu_default_layout(dist_run) -> None:
    results = dist_run(_from_mpu, 4, [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    built = dist_run(_built, 4)
    assert results == built  # the same groups as Topology.build's layout


def test_from_mpu_non_default_layout_keeps_the_mpu_groups(dist_run) -> None:
    # tensor groups {0,2},{1,3} (tensor outermost): the mpu's groups are honoured, not rebuilt in our layout
    results = dist_run(_from_mpu, 4, [[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert [r["shape"] for r in results] == [MeshShape(data=2, tensor=2)] * 4
    assert results[0]["layout"] == (0, 2, 1, 3)
    assert results[0]["tensor"] == ((0, 2), 0, 2.0)
    assert results[3]["tensor"] == ((1, 3), 1, 4.0)
    assert results[2]["data"] == ((2, 3), 0, 5.0)
    assert results[1]["model"] == ((1, 3), 0, 4.0)  # model = ranks sharing the data index, new groups
    assert results[0]["model"] == ((0, 2), 0, 2.0)
    assert all(r["world"] == ((0, 1, 2, 3), rank, 6.0) for rank, r in enumerate(results))


def _not_a_grid(rank: int, world: int) -> str:
    # data groups equal to the tensor groups: ranks 0 and 1 both claim (data 0, tensor 0)... not a grid
    return error_of(lambda: Topology.from_mpu(MegatronStyleMpu([[0, 1], [2, 3]], [[0, 1], [2, 3]])))


def test_from_mpu_not_a_grid_is_one_error_on_every_rank(dist_run) -> None:
    errors = dist_run(_not_a_grid, 4)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("MeshError: mpu layout: ranks 0 and "), errors[0]


def _device_mesh(rank: int, world: int, non_default: bool) -> dict:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if non_default:
        topology = Topology.from_mpu(MegatronStyleMpu([[0, 2], [1, 3]], [[0, 1], [2, 3]]))
    else:
        topology = Topology.build(MeshShape(data=2, tensor=2))
    mesh = topology.device_mesh()
    assert topology.device_mesh() is mesh  # cached
    tensor_group_ranks = tuple(dist.get_process_group_ranks(mesh["tensor"].get_group()))
    data_group_ranks = tuple(dist.get_process_group_ranks(mesh["data"].get_group()))
    local = torch.tensor([float(rank + 1)])
    summed = DTensor.from_local(local, mesh["tensor"], [Partial()]).redistribute(mesh["tensor"], [Replicate()])
    return {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "tensor": tensor_group_ranks,
        "ours": topology.tensor.ranks,
        "data": data_group_ranks,
        "sum": summed.to_local().item(),
        "same_group": mesh["tensor"].get_group() is topology.tensor.group,
    }


def test_device_mesh_over_our_groups(dist_run) -> None:
    for non_default in (False, True):
        results = dist_run(_device_mesh, 4, non_default)
        for r in results:
            assert r["names"] == ("pipe", "data", "tensor")
            assert r["shape"] == (1, 2, 2)
            assert r["tensor"] == r["ours"]
            assert r["same_group"]
            assert r["sum"] == sum(t + 1 for t in r["ours"])
        if non_default:
            assert results[0]["tensor"] == (0, 2) and results[0]["data"] == (0, 1)
        else:
            assert results[0]["tensor"] == (0, 1) and results[0]["data"] == (0, 2)
