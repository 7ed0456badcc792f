"""On CUDA: the fp16 dynamic loss scaler (overflow found on the device, step skipped, scale halved) and activation
checkpointing replaying the CUDA RNG (dropout inside a checkpointed block recomputes the same mask), through the
engine at stages 0 and 3."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import engine_config, max_diff, train
from cuda_support import requires_cuda
from parity import HIDDEN, IN, OUT

import shardspeed

pytestmark = [pytest.mark.cuda, requires_cuda]

SCALE_POWER = 20  # the first steps overflow fp16 (gradients ×2^20 pass 65504), later ones fit (CPU: 3-4 skips of 8)


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_loss_scaler_on_cuda_skips_overflows_and_halves(stage: int) -> None:
    fp16 = {"enabled": True, "initial_scale_power": SCALE_POWER, "hysteresis": 1, "loss_scale_window": 1000}
    result = train(0, 1, engine_config(stage, dtype="fp16", extra={"fp16": fp16}), steps=8)
    assert result["device"] == "cuda:0" and result["finite"]
    skipped = result["skipped_steps"]
    assert 1 <= skipped < 8, skipped  # overflows were found on the device and skipped; later steps applied
    assert result["loss_scale"] == 2.0 ** (SCALE_POWER - skipped)  # hysteresis 1: each overflow halves the scale
    losses = result["losses"]
    assert sum(losses[-4:]) < sum(losses[:4])  # the applied steps trained


class DropNet(torch.nn.Module):
    """The parity model's shape with dropout inside a block that may be checkpointed."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)  # seeds the CUDA generator too: both runs draw the same masks
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.checkpointed = checkpointed

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(self.mid(h)), 0.3, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = shardspeed.checkpointing.checkpoint(self.block, h) if self.checkpointed else self.block(h)
        return self.out(h)


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpointed_dropout_on_cuda_replays_the_rng(stage: int) -> None:
    plain = train(0, 1, engine_config(stage), model=DropNet(checkpointed=False))
    checkpointed = train(0, 1, engine_config(stage), model=DropNet(checkpointed=True))
    assert checkpointed["device"] == "cuda:0"
    assert checkpointed["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    diffs = max_diff(checkpointed["params"], plain["params"])
    assert max(diffs.values()) <= 1e-6, diffs  # the recompute drew the forward's masks (else gradients differ)
