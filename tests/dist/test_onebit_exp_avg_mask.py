"""DeepSpeed's ``exp_avg_mask`` param-group key in the three 1-bit optimizers at world 2 (gloo, bound to
``Collectives`` directly): momentum rows that the mask zeroes stay exactly zero through the compressed phase,
so parameters whose gradient is always zero there do not move (without the mask, 1-bit compression cannot send
an exact zero and they drift by the compression error)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from onebit_workers import shardspeed_messages

from harness import run_ranks
from shardspeed.comm import Collectives, CommsLog
from shardspeed.compression.onebit_adam import OneBitAdam
from shardspeed.compression.onebit_lamb import OneBitLamb
from shardspeed.compression.zero_one_adam import ZeroOneAdam
from shardspeed.topology import AxisGroup

STEPS = 12
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "OneBitAdam": (OneBitAdam, {"lr": 0.01, "freeze_step": 3}),
    "ZeroOneAdam": (ZeroOneAdam, {"lr": 0.01, "var_freeze_step": 6, "var_update_scaler": 1, "local_step_scaler": 1,
                                  "local_step_clipper": 2}),
    "OneBitLamb": (OneBitLamb, {"lr": 0.01, "freeze_step": 3}),
}  # fmt: skip


def _train(rank: int, world: int, name: str, masked: bool) -> torch.Tensor:
    cls, kwargs = CASES[name]
    c = Collectives(CommsLog(enabled=False))
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    other = torch.nn.Parameter(torch.randn(5, generator=gen))
    mask = torch.ones(8, 4)
    mask[4:] = 0.0  # rows 4..7: never trained (BERT's unused position rows)
    group: dict[str, Any] = {"params": [weight]}
    if masked:
        group["exp_avg_mask"] = mask
    opt = cls([group, {"params": [other]}], **kwargs)
    opt.bind(c, axis)
    start = weight.detach().clone()
    local = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        weight.grad = torch.randn(8, 4, generator=local) * mask
        other.grad = torch.randn(5, generator=local)
        opt.step()
    return (weight.detach() - start)[4:].abs().max()


@pytest.mark.parametrize("name", list(CASES))
def test_masked_momentum_rows_stay_zero(tmp_path: Any, name: str) -> None:
    moved = run_ranks(_train, 2, tmp_path, name, True)
    assert all(m == 0 for m in moved), moved
    unmasked = run_ranks(_train, 2, tmp_path, name, False)
    assert all(m > 0 for m in unmasked), unmasked  # the case the mask exists for


def _starved_warnings(rank: int, world: int, masked: bool) -> list[str]:
    with shardspeed_messages() as records:
        _train(rank, world, "OneBitAdam", masked)
    return [r for r in records if "frozen variance is below eps" in r]


def test_onebit_adam_warns_once_about_unmasked_zero_gradient_elements(tmp_path: Any) -> None:
    """[Note: starved elements]: rows whose gradient was zero through the warm-up are named at the first
    compressed step (once, on the data axis' rank 0), unless the exp_avg_mask zeroes them."""
    unmasked = run_ranks(_starved_warnings, 2, tmp_path, False)
    assert len(unmasked[0]) == 1 and "group 0 parameter 0 (8, 4): 16 of 32" in unmasked[0][0], unmasked
    assert unmasked[1] == []  # rank 1 of the data axis stays quiet
    assert run_ranks(_starved_warnings, 2, tmp_path, True) == [[], []]
