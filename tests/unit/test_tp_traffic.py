"""The expected tensor-parallel traffic per block (tensor_parallel/traffic.py), pure."""

from __future__ import annotations

import pytest

from shardspeed.tensor_parallel.traffic import block_traffic, sequence_boundary_traffic

B, S, H = 2, 8, 16
A = B * S * H


def test_without_sequence_parallelism_two_all_reduces_each_way() -> None:
    t = block_traffic(B, S, H, 2, sequence_parallel=False)
    assert t.by_key() == {"all_reduce:tp.g.forward": (2, 2 * A), "all_reduce:tp.f.backward": (2, 2 * A)}
    assert t.algorithmic_elements(2) == 2 * (2 * A * 2 * (2 - 1) / 2)  # 2·(n-1)/n per all-reduce
    assert t.algorithmic_elements(4) == 4 * A * 2 * 3 / 4


def test_with_sequence_parallelism_the_same_bytes_as_the_all_reduces() -> None:
    h = H
    t = block_traffic(B, S, H, 4, sequence_parallel=True, partial_grad_numels=(h, h, h, h, h, h))
    assert t.by_key() == {
        "all_gather:sp.f.forward": (2, 2 * A),
        "reduce_scatter:sp.g.forward": (2, 2 * A),
        "reduce_scatter:sp.f.backward": (2, 2 * A),
        "all_gather:sp.g.backward": (2, 2 * A),  # no re-gathers: the column layer saves its gathered input
        "all_reduce:tp.partial_grad": (6, 6 * h),
    }
    plain = block_traffic(B, S, H, 4, sequence_parallel=False)
    assert t.algorithmic_elements(4, activations_only=True) == plain.algorithmic_elements(4)
    assert t.activation_elements() == 2 * plain.activation_elements()  # logged at unsharded size, half the factor


def test_separate_qkv_enter_the_region_three_times() -> None:
    assert block_traffic(B, S, H, 2, sequence_parallel=False, qkv_layers=3).by_key()["all_reduce:tp.f.backward"] == (
        4,
        4 * A,
    )
    sp = block_traffic(B, S, H, 2, sequence_parallel=True, qkv_layers=3).by_key()
    assert sp["all_gather:sp.f.forward"] == (4, 4 * A) and sp["reduce_scatter:sp.f.backward"] == (4, 4 * A)
    with pytest.raises(ValueError, match="qkv_layers"):
        block_traffic(B, S, H, 2, sequence_parallel=False, qkv_layers=2)


def test_one_rank_moves_nothing_and_blocks_scale() -> None:
    assert block_traffic(B, S, H, 1, sequence_parallel=True).by_key() == {}
    two = block_traffic(B, S, H, 2, sequence_parallel=False).scaled(3).by_key()
    assert two == {"all_reduce:tp.g.forward": (6, 6 * A), "all_reduce:tp.f.backward": (6, 6 * A)}


def test_region_boundary_is_counted_apart() -> None:
    assert sequence_boundary_traffic(B, S, H, 2).by_key() == {
        "all_gather:sp.leave.forward": (1, A),
        "all_gather:sp.scatter.backward": (1, A),
    }
    tp_head = sequence_boundary_traffic(B, S, H, 2, head_is_tensor_parallel=True).by_key()
    assert tp_head["reduce_scatter:sp.leave.backward"] == (1, A)
