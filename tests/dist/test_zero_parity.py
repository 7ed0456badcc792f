"""ZeRO stages 0-2 equal plain torch on the full global batch (fp32, 5 steps, GAS 2, clipping, AdamW and SGD)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import (
    global_batches,
    make_model,
    optimizer_config,
    rank_slice,
    reference_run,
    two_groups,
)

import shardspeed

STEPS, MB, GAS, LR, CLIP = 5, 2, 2, 0.05, 0.5


def _train(
    rank: int, world: int, kind: str, stage: int = 0, model_kwargs: dict | None = None, groups: bool = False
) -> dict:
    model = make_model(**(model_kwargs or {}))
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer_config(kind, LR),
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    params = two_groups(model, LR) if groups else model.parameters()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=params, config=config)
    norms = []
    for x, y in global_batches(STEPS, MB * GAS * world):
        for m in range(GAS):
            loss = F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB))
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == STEPS and engine.global_samples == STEPS * MB * GAS * world
    full = engine.module_state_dict()
    return {"params": {n: full[n] for n, _ in engine.module.named_parameters()}, "norms": norms}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_zero_matches_torch(dist_run, stage: int, world: int, kind: str) -> None:
    results = dist_run(_train, world, kind, stage)
    ref, ref_norms = reference_run(kind, LR, CLIP, global_batches(STEPS, MB * GAS * world))
    initial = dict(make_model().named_parameters())
    assert max(ref_norms) > CLIP, "clipping must be active for the test to mean something"
    for r in results:
        for name, p in r["params"].items():
            assert (p - ref[name]).abs().max().item() <= 1e-5, name
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
    moved = max((ref[n] - initial[n]).abs().max().item() for n in ref)
    assert moved >= 1e-3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_tied_frozen_unused(dist_run, stage: int, kind: str) -> None:
    kwargs = {"tied": True, "frozen": True, "unused": True}
    results = dist_run(_train, 4, kind, stage, kwargs)
    ref, _ = reference_run(kind, LR, CLIP, global_batches(STEPS, MB * GAS * 4), kwargs)
    for name, p in results[0]["params"].items():
        assert (p - ref[name]).abs().max().item() <= 1e-5, name
    assert torch.equal(results[0]["params"]["inp.bias"], make_model(**kwargs).inp.bias)  # frozen stays put


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["lamb", "lion"])
def test_lamb_and_lion_over_shards(dist_run, stage: int, kind: str) -> None:
    """Lamb's per-parameter trust ratios survive sharding (norms summed across shards); Lion is element-wise."""
    results = dist_run(_train, 4, kind, stage)
    ref, _ = reference_run(kind, LR, CLIP, global_batches(STEPS, MB * GAS * 4))
    initial = dict(make_model().named_parameters())
    for r in results:
        for name, p in r["params"].items():
            assert (p - ref[name]).abs().max().item() <= 1e-5, name
    assert max((ref[n] - initial[n]).abs().max().item() for n in ref) >= 1e-3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_groups_keep_their_hyperparameters(dist_run, stage: int) -> None:
    results = dist_run(_train, 2, "adamw", stage, None, True)
    ref, _ = reference_run("adamw", LR, CLIP, global_batches(STEPS, MB * GAS * 2), groups=True)
    plain, _ = reference_run("adamw", LR, CLIP, global_batches(STEPS, MB * GAS * 2))
    assert (ref["inp.bias"] - plain["inp.bias"]).abs().max() > 1e-3  # the groups really differ
    for r in results:
        for name, p in r["params"].items():
            assert (p - ref[name]).abs().max().item() <= 1e-5, name
