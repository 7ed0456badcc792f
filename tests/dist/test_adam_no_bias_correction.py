"""Adam with ``bias_correction: false`` (DeepSpeed accepts it; it builds ``shardspeed.ops.adam.FusedAdam``) over ZeRO
shards equals the same optimizer on the full global batch in one process (fp32, world 2, GAS 2, clipping)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice

import shardspeed
from shardspeed.ops.adam import FusedAdam

STEPS, MB, GAS, LR, CLIP, WORLD = 4, 2, 2, 0.05, 0.5, 2
ADAM = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01, "bias_correction": False}}


def _train(rank: int, world: int, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": ADAM,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=make_model(), config=config)
    for x, y in global_batches(STEPS, MB * GAS * world):
        for m in range(GAS):
            loss = F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB))
            engine.backward(loss)
            engine.step()
    full = engine.module_state_dict()
    return {n: full[n] for n, _ in engine.module.named_parameters()}


def _reference() -> dict[str, torch.Tensor]:
    model = make_model()
    opt = FusedAdam(model.parameters(), lr=LR, weight_decay=0.01, bias_correction=False)
    for x, y in global_batches(STEPS, MB * GAS * WORLD):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_adam_without_bias_correction_matches_over_shards(dist_run, stage: int) -> None:
    results = dist_run(_train, WORLD, stage)
    ref = _reference()
    corrected = make_model()  # the same run with bias correction on must differ: the flag is really applied
    opt = torch.optim.AdamW(corrected.parameters(), lr=LR, weight_decay=0.01)
    for x, y in global_batches(STEPS, MB * GAS * WORLD):
        opt.zero_grad()
        F.mse_loss(corrected(x), y).backward()
        torch.nn.utils.clip_grad_norm_(corrected.parameters(), CLIP)
        opt.step()
    assert max((ref[n] - p.detach()).abs().max().item() for n, p in corrected.named_parameters()) > 1e-3
    for r in results:
        for name, p in r.items():
            assert (p - ref[name]).abs().max().item() <= 1e-5, name
