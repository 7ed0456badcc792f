"""bf16 master weights (+ bf16 optimizer states): the model-state bytes each rank holds at stages 0-3, and
checkpoints (exact resume, resume across fp32-master and bf16-master runs, resharding across stages).

Table (bytes per rank, Ψ = padded trainable elements, N = data-parallel ranks, Adam):
  stage 0: params 2Ψ + grads 2Ψ   + states 4Ψ          stage 1: 2Ψ + 2Ψ   + 4Ψ/N
  stage 2: params 2Ψ + grads 2Ψ/N + states 4Ψ/N        stage 3: 2Ψ/N + 2Ψ/N + 4Ψ/N
against fp32 masters under bf16 (stage 0: 2Ψ + 4Ψ + 12Ψ): DeepSpeed's README figures (10Ψ vs 18Ψ) include a
separate bf16 master copy (2Ψ) that shardspeed does not keep ([Note: low-precision masters]).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import IN, OUT, make_model

import shardspeed
from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

WIDTH, DEPTH, MB = 32, 3, 2
FULL_BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}

# bytes per element of Ψ: (replicated part, part divided by N), params + grads + Adam states
TABLE = {0: (2 + 2 + 4, 0), 1: (2 + 2, 4), 2: (2, 2 + 4), 3: (0, 2 + 2 + 4)}


def _measure(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0},
        "bf16": FULL_BF16,
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(MB, WIDTH).bfloat16()
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x).float(), torch.zeros(MB, WIDTH)))
        engine.step()
    return {
        "breakdown": engine.memory_breakdown(),
        "psi": engine.states.padded_numel,
        "numel": sum(p.numel() for p in model.parameters()),
        "stepped": len(engine.optimizer.state),
        "predicted": engine.predicted_memory,
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_master_model_state_bytes_match_table(dist_run, stage: int) -> None:
    world = 2
    for r in dist_run(_measure, world, stage):
        psi, breakdown = r["psi"], dict(r["breakdown"])
        breakdown.pop("peak_bucket_bytes")
        # Adam's per-tensor 'step' counters are fp32 scalars: 4 bytes per stepped tensor on top of the table
        steps = 4 * r["stepped"]
        full, sharded = TABLE[stage]
        assert sum(breakdown.values()) == full * psi + sharded * psi // world + steps, breakdown
        assert not any("master" in role for role in breakdown)  # no master copy at all
        assert breakdown["optimizer_states"] == 4 * (psi if stage == 0 else psi // world) + steps
        predicted = r["predicted"]
        assert predicted.optimizer == breakdown["optimizer_states"] - steps
        assert predicted.params + predicted.grads == sum(breakdown.values()) - breakdown["optimizer_states"]


GLOBAL_BATCH = 8


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, IN, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(IN, OUT, generator=g)))


def _run(rank: int, world: int, stage: int, bf16: dict, steps: int, save_to: str | None, load_from: str | None):
    model = make_model()
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "bf16": bf16,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine, _, loader, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=_dataset(), config=config
    )
    loaded = None
    if load_from is not None:
        path, _ = engine.load_checkpoint(load_from)
        assert path is not None
        loaded = {k: v.float().clone() for k, v in engine.module_state_dict().items()}
    batches = iter(shardspeed.RepeatingLoader(loader))
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        engine.backward(F.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    if save_to is not None:
        engine.save_checkpoint(save_to)
    state = engine.optimizer.state
    return {
        "params": {k: v.float().clone() for k, v in engine.module_state_dict().items()},
        "loaded": loaded,
        "state_dtypes": {t.dtype for s in state.values() for k, t in s.items() if k != "step" and t.numel() > 0},
    }


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s != 3 else 3 for s in (0, 1, 2, 3)])
def test_bf16_master_resume_equals_uninterrupted(dist_run, tmp_path: Path, stage: int) -> None:
    where = str(tmp_path / "ckpt")
    full = dist_run(_run, 2, stage, FULL_BF16, 4, None, None)
    saved = dist_run(_run, 2, stage, FULL_BF16, 2, where, None)
    resumed = dist_run(_run, 2, stage, FULL_BF16, 2, None, where)
    # zero_to_fp32 reads the bf16 values back (exactly: bf16 → fp32 is lossless)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(where)
    for name, value in saved[0]["params"].items():
        assert consolidated[name].dtype == torch.float32 and torch.equal(consolidated[name], value), name
    for a, b in zip(full, resumed):
        assert b["state_dtypes"] == {torch.bfloat16}
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "loaded"), [((FULL_BF16, 3), ({"enabled": True}, 1)), (({"enabled": True}, 1), (FULL_BF16, 3))]
)
def test_resume_across_master_dtypes(dist_run, tmp_path: Path, saved: tuple, loaded: tuple) -> None:
    """A checkpoint of one master dtype loads into the other (values and Adam states cast on load, as torch's
    ``Optimizer.load_state_dict`` casts states to the stepped tensor's dtype), and across stages."""
    where = str(tmp_path / "ckpt")
    (s_bf16, s_stage), (l_bf16, l_stage) = saved, loaded
    before = dist_run(_run, 2, s_stage, s_bf16, 3, where, None)
    after = dist_run(_run, 2, l_stage, l_bf16, 1, None, where)
    expected_states = {torch.bfloat16} if l_bf16.get("bf16_optimizer_states") else {torch.float32}
    for b, a in zip(before, after):
        assert a["state_dtypes"] == expected_states
        for name, value in b["params"].items():
            # bf16 parameters either way: what was saved is what the loaded run starts from
            assert torch.equal(a["loaded"][name], value), name
