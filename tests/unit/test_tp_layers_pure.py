"""Slicing of the tensor-parallel layers without processes: a layer only communicates in forward/backward, so any
tensor rank of any size can be built in one process (an ``AxisGroup`` with no group) and its slice inspected."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardspeed.params import ParamSpecs, shard_bounds
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.tensor_parallel.partial_grads import partial_grad_params, register_partial_grad_hooks
from shardspeed.tensor_parallel.sequence import SequenceParallel, partial_grad_specs
from shardspeed.topology import AxisGroup


def tp_at(rank: int, size: int, *, sp: bool = False) -> TensorParallel:
    return TensorParallel(AxisGroup("tensor", None, tuple(range(size)), rank), sequence_parallel=sp)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_column_weight_bytes_are_ceil_chunks(size: int, layout: str) -> None:
    h, out = 8, 13  # 13 is divisible by none of 2, 3, 4
    chunk = math.ceil(out / size)
    for rank in range(size):
        layer = ColumnParallelLinear(h, out, tp_at(rank, size), weight_layout=layout)
        expected = min(chunk, max(0, out - rank * chunk))  # the last rank holds the remainder
        assert layer.local_out_features == expected
        shape = (expected, h) if layout == "out_in" else (h, expected)
        assert tuple(layer.weight.shape) == shape
        assert layer.weight.numel() * layer.weight.element_size() == expected * h * 4
        assert layer.bias.numel() * layer.bias.element_size() == expected * 4


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_row_weight_bytes_are_ceil_chunks_and_bias_is_whole(size: int, layout: str) -> None:
    inp, h = 13, 8
    chunk = math.ceil(inp / size)
    for rank in range(size):
        layer = RowParallelLinear(inp, h, tp_at(rank, size), weight_layout=layout)
        expected = min(chunk, max(0, inp - rank * chunk))
        assert layer.local_in_features == expected
        assert tuple(layer.weight.shape) == ((h, expected) if layout == "out_in" else (expected, h))
        assert layer.weight.numel() * layer.weight.element_size() == expected * h * 4
        assert tuple(layer.bias.shape) == (h,)  # replicated, added once after the sum


def test_figures_for_tp2_are_exact() -> None:
    """The issue's figure, spelled out: a 13-wide split at TP=2 holds 7 then 6 rows of 8 fp32 each."""
    bytes_per_rank = [ColumnParallelLinear(8, 13, tp_at(r, 2)).weight.nbytes for r in range(2)]
    assert bytes_per_rank == [7 * 8 * 4, 6 * 8 * 4]


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_fused_qkv_holds_whole_heads_of_each_part(layout: str, size: int) -> None:
    h = 16
    torch.manual_seed(0)
    dense = ColumnParallelLinear(h, 3 * h, tp_at(0, 1), parts=3, weight_layout=layout)
    w = dense.weight if layout == "out_in" else dense.weight.T  # [3h, h]
    for rank in range(size):
        torch.manual_seed(0)
        layer = ColumnParallelLinear(h, 3 * h, tp_at(rank, size), parts=3, weight_layout=layout)
        local = layer.weight if layout == "out_in" else layer.weight.T
        per = h // size
        assert tuple(local.shape) == (3 * per, h)
        for part in range(3):  # q, k and v each contribute their own rank's rows
            got = local[part * per : (part + 1) * per]
            want = w[part * h + rank * per : part * h + (rank + 1) * per]
            assert torch.equal(got, want)
        bias_want = torch.cat([dense.bias[p * h + rank * per : p * h + (rank + 1) * per] for p in range(3)])
        assert torch.equal(layer.bias, bias_want)


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_slices_under_one_seed_reassemble_the_dense_init(cls: type, layout: str) -> None:
    inp, out, size = 9, 13, 3
    torch.manual_seed(5)
    dense = cls(inp, out, tp_at(0, 1), weight_layout=layout)
    dim = dense.weight_spec.partition_dim
    pieces = []
    for rank in range(size):
        torch.manual_seed(5)
        pieces.append(cls(inp, out, tp_at(rank, size), weight_layout=layout).weight)
    assert torch.equal(torch.cat(pieces, dim=dim), dense.weight)


def test_load_dense_takes_this_ranks_slice() -> None:
    w, b = torch.randn(13, 8), torch.randn(13)
    layer = ColumnParallelLinear(8, 13, tp_at(1, 2))
    layer.load_dense(w, b)
    lo, hi = shard_bounds(13, 2, 1)
    assert torch.equal(layer.weight, w[lo:hi]) and torch.equal(layer.bias, b[lo:hi])
    with pytest.raises(ValueError, match="bias"):
        layer.load_dense(w, None)


def test_row_layer_refuses_an_unsplit_input_with_fused_parts() -> None:
    with pytest.raises(ValueError, match="input_is_parallel=False with fused parts"):
        RowParallelLinear(12, 4, tp_at(0, 2), parts=3, input_is_parallel=False)


def test_row_bias_declares_a_partial_gradient_only_under_sequence_parallelism() -> None:
    assert RowParallelLinear(8, 4, tp_at(0, 2, sp=True)).tensor_parallel_specs()["bias"].partial_grad
    assert not RowParallelLinear(8, 4, tp_at(0, 2)).tensor_parallel_specs()["bias"].partial_grad
    assert not RowParallelLinear(8, 4, tp_at(0, 1, sp=True)).tensor_parallel_specs()["bias"].partial_grad


class _Block(nn.Module):
    def __init__(self, tp: TensorParallel, wrap: bool) -> None:
        super().__init__()
        self.tp = tp
        self.ln = SequenceParallel(nn.LayerNorm(4), tp) if wrap else nn.LayerNorm(4)
        self.fc = ColumnParallelLinear(4, 6, tp)
        self.proj = RowParallelLinear(6, 4, tp)
        self.wrap = wrap

    def tensor_parallel_specs(self) -> dict:
        return {} if self.wrap else partial_grad_specs(self.ln, "ln", self.tp)


@pytest.mark.parametrize("wrap", [False, True])
def test_sequence_parallel_norms_are_declared_partial(wrap: bool) -> None:
    tp = tp_at(0, 2, sp=True)
    block = _Block(tp, wrap)
    specs = ParamSpecs.collect(block, 0, 2)
    ln = "ln.module" if wrap else "ln"
    names = [n for n, _ in partial_grad_params(block, specs)]
    assert names == [f"{ln}.weight", f"{ln}.bias", "proj.bias"]
    assert specs.by_name(f"{ln}.weight").global_shape == (4,)
    assert not specs.by_name(f"{ln}.weight").partitioned


def test_without_sequence_parallelism_nothing_is_partial() -> None:
    for tp in (tp_at(0, 2), tp_at(0, 1, sp=True)):
        block = _Block(tp, wrap=True)
        assert partial_grad_params(block, ParamSpecs.collect(block, tp.rank, tp.size)) == []


def test_hooks_skip_a_tensor_axis_of_one() -> None:
    tp = tp_at(0, 1, sp=True)
    block = _Block(tp, wrap=False)
    assert register_partial_grad_hooks(block, ParamSpecs.collect(block), tp.axis, tp.collectives) == []


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_one_rank_layers_are_plain_linear_layers(layout: str) -> None:
    """The dense reference of the multi-rank tests (the same classes at tensor size 1) is plain torch."""
    torch.manual_seed(3)
    fc = ColumnParallelLinear(8, 13, tp_at(0, 1), weight_layout=layout)
    proj = RowParallelLinear(13, 8, tp_at(0, 1), weight_layout=layout)
    x = torch.randn(2, 5, 8)
    w1 = fc.weight if layout == "out_in" else fc.weight.T
    w2 = proj.weight if layout == "out_in" else proj.weight.T
    want = nn.functional.linear(torch.tanh(nn.functional.linear(x, w1, fc.bias)), w2, proj.bias)
    torch.testing.assert_close(proj(torch.tanh(fc(x))), want, rtol=0, atol=1e-6)
