"""Per-rank model-state bytes against the precision × stage table, counted by an allocation tracker.

Measured after the last micro-step's backward and before ``step()`` on step 3 (Adam states exist). Ψ is the
padded number of trainable elements (each bucket padded to a multiple of N). Tables (bytes per rank):

  fp32 (no master copy)     stage 0: 4Ψ + 4Ψ + 8Ψ    stage 1: 4Ψ + 4Ψ + 8Ψ/N      stage 2: 4Ψ + 4Ψ/N + 8Ψ/N
  bf16 (fp32 accumulation)  stage 0: 2Ψ + 4Ψ + 12Ψ   stage 1: 2Ψ + 4Ψ + 12Ψ/N     stage 2: 2Ψ + 4Ψ/N + 12Ψ/N

The paper's mixed-precision table has 2Ψ of fp16 gradients where shardspeed keeps 4Ψ of fp32 ones (stage 2:
4Ψ/N instead of 2Ψ/N): gradients are accumulated across micro-steps and reduced in fp32, since bf16's 8-bit
mantissa drops small per-micro-step contributions. The low-precision gradient only exists per parameter inside
backward.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

import shardspeed

WIDTH, DEPTH, MB, GAS = 96, 4, 2, 2

# bytes per element of Ψ: (replicated part, part divided by N)
TABLE = {
    ("fp32", 0): (4 + 4 + 8, 0),
    ("fp32", 1): (4 + 4, 8),
    ("fp32", 2): (4, 4 + 8),
    ("bf16", 0): (2 + 4 + 12, 0),
    ("bf16", 1): (2 + 4, 12),
    ("bf16", 2): (2, 4 + 12),
}


def _measure(rank: int, world: int, stage: int, precision: str) -> dict:
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        config = {
            "train_micro_batch_size_per_gpu": MB,
            "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000},
            "bf16": {"enabled": precision == "bf16"},
            "steps_per_print": 1000,
        }
        engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        dtype = next(model.parameters()).dtype
        x = torch.randn(MB, WIDTH).to(dtype)
        for step in range(3):
            for micro in range(GAS):
                tracker.reset_mod_stats()  # we read totals only; per-module stats are per iteration
                loss = F.mse_loss(engine(x).float(), torch.zeros(MB, WIDTH))
                engine.backward(loss)
                if step == 2 and micro == GAS - 1:
                    # gloo's worker thread drops its reference to a finished collective's output just *after*
                    # wait() returns; give it a moment so transient comm outputs are not counted as states.
                    time.sleep(0.05)
                    tracked = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
                    breakdown = engine.memory_breakdown()
                    del loss
                engine.step()
    layout = getattr(engine.states, "layout", None)
    return {"tracked": tracked, "breakdown": breakdown, "psi": layout.total, "predicted": engine.predicted_memory}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_match_table(dist_run, world: int, stage: int, precision: str) -> None:
    for r in dist_run(_measure, world, stage, precision):
        psi = r["psi"]
        full, sharded = TABLE[(precision, stage)]
        expected = full * psi + sharded * psi // world
        breakdown = dict(r["breakdown"])
        bucket_bytes = breakdown.pop("peak_bucket_bytes")
        listed = sum(breakdown.values())
        # the engine's own list equals the table, up to Adam's per-tensor 'step' counters
        assert expected <= listed <= expected * 1.01, (breakdown, expected)
        # and an allocation tracker that sees every tensor (gradients included) agrees within 2%
        assert abs(r["tracked"] - listed) <= 0.02 * listed, (r["tracked"], listed, breakdown)
        # stage 2 stages its buckets; stages 0/1 stage only wire copies, which bf16 reductions (the default under
        # bf16: communication_data_type follows the training dtype) need and fp32 ones do not
        assert (bucket_bytes > 0) == (stage == 2 or precision == "bf16")
        # the prediction reported at init (the memory model) agrees with what was allocated
        assert abs(r["predicted"].total() - listed) <= 0.01 * listed, (r["predicted"], breakdown)
