"""The memory model's "bf16" precision (bf16 master weights + bf16 optimizer states): exact bytes per rank."""

from __future__ import annotations

import pytest

from shardspeed.zero.memory import bytes_per_param, model_state_bytes


def test_bf16_bytes_per_param() -> None:
    per = bytes_per_param("bf16", "shardspeed")
    assert (per.params, per.grads, per.optimizer) == (2, 2, 4)  # no separate master copy
    paper = bytes_per_param("bf16", "paper")
    assert (paper.params, paper.grads, paper.optimizer) == (2, 2, 4)  # the same under both accountings
    assert "bf16 momentum 2 + variance 2" in per.describe()


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, (2 * 1000, 2 * 1000, 4 * 1000)), (1, (2000, 2000, 1000)), (2, (2000, 500, 1000)), (3, (500, 500, 1000))],
)
def test_bf16_model_state_bytes_per_stage(stage: int, expected: tuple[int, int, int]) -> None:
    got = model_state_bytes(1000, 4, stage, precision="bf16", accounting="shardspeed")
    assert (got.params, got.grads, got.optimizer) == expected
    # against fp32 masters under bf16 (shardspeed accounting: fp32 gradients, 12 B of master + Adam states)
    mixed = model_state_bytes(1000, 4, stage, precision="mixed", accounting="shardspeed")
    assert got.total() < mixed.total()


def test_bf16_has_no_offload_rows() -> None:
    from shardspeed.zero.memory import estimate_zero_memory

    rows = estimate_zero_memory(num_params=1000, precision="bf16", print_table=False)
    assert len(rows) == 4 and all("offload_optimizer=none" in str(row) for row in rows), rows
    with pytest.raises(ValueError, match="cannot be combined with offload"):
        model_state_bytes(1000, 2, 3, precision="bf16", offload_optimizer=True)
