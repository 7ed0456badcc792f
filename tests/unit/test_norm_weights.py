"""The pure parts of the norm over a tensor axis ([Note: norm counted once] in precision/norm_weights.py): which
parameters a rank leaves out, the counted runs of a flat shard, the all-reduce scopes, Lamb's table axes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.params.spec import ParamSpec, ParamSpecs
from shardspeed.precision.norm_weights import (
    NormScope,
    counted_runs,
    counted_views,
    counted_weights,
    excluded_names,
)
from shardspeed.topology import AXES, SCOPES, AxisGroup, MeshShape, Topology, coords_of, scope_groups
from shardspeed.zero.sharded_lamb import lamb_norm_axes


class Sliced(nn.Module):
    """A column-split weight, a replicated (declared) bias; ``norm`` below is undeclared."""

    def __init__(self, tp_rank: int) -> None:
        super().__init__()
        self.spec = ParamSpec((4, 3), partition_dim=0)
        self.weight = nn.Parameter(torch.zeros(self.spec.local_shape(tp_rank, 2)))
        self.bias = nn.Parameter(torch.zeros(4))

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return {"weight": self.spec, "bias": ParamSpec((4,))}


def _specs(tp_rank: int) -> ParamSpecs:
    model = nn.Module()
    model.lin = Sliced(tp_rank)
    model.norm = nn.LayerNorm(3)
    return ParamSpecs.collect(model, tp_rank, 2)


NAMES = ["lin.weight", "lin.bias", "norm.weight", "norm.bias"]


def test_tensor_rank_0_counts_everything() -> None:
    assert excluded_names(_specs(0), NAMES) == frozenset()
    assert counted_weights(_specs(0), NAMES) == [1.0, 1.0, 1.0, 1.0]


def test_other_tensor_ranks_count_only_partitioned_parameters() -> None:
    assert excluded_names(_specs(1), NAMES) == {"lin.bias", "norm.weight", "norm.bias"}
    assert counted_weights(_specs(1), NAMES) == [1.0, 0.0, 0.0, 0.0]


def test_lamb_counts_tied_copies_the_norm_leaves_out() -> None:
    """Lamb's table is never summed over the pipe axis: a tied copy needs its own whole norms on its stage (else
    its trust ratio falls back to 1 and the copies drift apart), while the global norm counts only the owner's."""
    for tp_rank, replicated in ((0, 1.0), (1, 0.0)):
        base = _specs(tp_rank)
        specs = ParamSpecs(base._by_name, base._by_id, tp_rank, 2, frozenset({"norm.weight", "lin.weight"}))
        assert {"norm.weight", "lin.weight"} <= excluded_names(specs, NAMES)
        assert counted_weights(specs, NAMES) == [1.0, replicated, replicated, replicated]


def test_without_a_tensor_axis_nothing_is_excluded() -> None:
    specs = ParamSpecs.collect(nn.Linear(3, 2), 0, 1)
    assert excluded_names(specs, ["weight", "bias"]) == frozenset()


@pytest.mark.parametrize(
    ("spans", "window", "runs"),
    [
        ([], (0, 10), [(0, 10)]),  # nothing excluded: one run, the whole window
        ([(2, 5)], (0, 10), [(0, 2), (5, 10)]),
        ([(0, 4), (4, 10)], (0, 10), []),  # all excluded
        ([(8, 14)], (10, 20), [(4, 10)]),  # a span reaching into the window from before
        ([(12, 15), (3, 6)], (10, 20), [(0, 2), (5, 10)]),  # outside spans ignored, order of spans irrelevant
        ([(11, 13), (12, 16)], (10, 20), [(0, 1), (6, 10)]),  # overlapping spans (defensive)
        ([(20, 30)], (10, 20), [(0, 10)]),  # touching the end: not inside
    ],
)
def test_counted_runs(spans, window, runs) -> None:
    assert counted_runs(spans, window) == runs


def test_counted_views_sum_only_the_counted_elements() -> None:
    flat = torch.arange(12, dtype=torch.float32)
    shards = [flat[0:6], flat[6:12]]  # two windows of one flat buffer
    views = counted_views(shards, [(0, 6), (6, 12)], [(4, 8)])
    assert torch.cat(views).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    same = counted_views(shards, [(0, 6), (6, 12)], [])
    assert all(a is b for a, b in zip(same, shards))  # DP-only: the shards themselves, no slicing


def _topology(shape: MeshShape, rank: int) -> Topology:
    """A topology's axes without process groups (the pure mesh math only)."""
    coords = coords_of(rank, shape)
    axes = {}
    for scope, scope_axes in SCOPES.items():
        own = next(g for g in scope_groups(shape, scope_axes) if rank in g)
        axes[scope] = AxisGroup(scope, None, own, own.index(rank))
    assert all(axes[a].rank == coords[a] for a in AXES)
    return Topology(shape, rank, axes)


def test_scope_dp_only_is_what_it_was() -> None:
    topo = _topology(MeshShape(data=4), 1)
    scope = NormScope.for_topology(topo, ParamSpecs.collect(nn.Linear(2, 2)), ["weight", "bias"])
    assert scope.excluded == frozenset()
    assert scope.whole_grads is None  # stage 0: no collective
    assert scope.sharded_grads is topo.data  # stages 1-3: the data axis, as before


def test_scope_with_a_tensor_axis() -> None:
    topo = _topology(MeshShape(data=2, tensor=2), 3)  # tensor rank 1, data rank 1
    scope = NormScope.for_topology(topo, _specs(1), NAMES)
    assert scope.excluded == {"lin.bias", "norm.weight", "norm.bias"}
    assert scope.whole_grads is topo.model and topo.model.ranks == (2, 3)
    assert scope.sharded_grads is topo.world and topo.world.size == 4


def test_lamb_table_axes() -> None:
    dp_only = _topology(MeshShape(data=2), 0)
    assert lamb_norm_axes(dp_only, sharded=True) == [dp_only.data]
    tp_dp = _topology(MeshShape(data=2, tensor=2), 0)
    assert lamb_norm_axes(tp_dp, sharded=False) == [tp_dp.tensor]  # stage 0: slices only
    assert lamb_norm_axes(tp_dp, sharded=True) == [tp_dp.world]  # data × tensor is the world: one all-reduce
    with_pipe = _topology(MeshShape(pipe=2, data=2, tensor=2), 0)
    assert lamb_norm_axes(with_pipe, sharded=True) == [with_pipe.data, with_pipe.tensor]  # never over pipe
