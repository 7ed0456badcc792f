"""The legacy seqlen curriculum in a world-of-one engine (training/curriculum.py): what the model's forward receives,
truncation, DeepSpeed's scheduler API, logging, checkpoint resume."""

from __future__ import annotations

import logging

import pytest
import torch

import shardspeed
from shardspeed.training.curriculum import CURRICULUM_TAG, truncate_batch

FULL = 16


class SeqModel(torch.nn.Module):
    """Records what forward receives; the loss depends on the sequence length it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)
        self.seen: list[tuple[int, int | None]] = []

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, curriculum_seqlen: int | None = None):
        self.seen.append((tokens.shape[1], curriculum_seqlen))
        if curriculum_seqlen is not None:  # Megatron-style: the model cuts its inputs itself
            tokens, targets = tokens[:, :curriculum_seqlen], targets[:, :curriculum_seqlen]
        logits = self.emb(tokens) @ self.emb.weight.T
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _config(**section) -> dict:
    cl = {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 4,
        "max_difficulty": FULL,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 4},
        **section,
    }
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1,
        "curriculum_learning": cl,
    }


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (2, FULL), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _run(engine, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        for micro in range(2):
            loss = engine(*_batch(10 * step + micro))
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    return losses


def _engine(config: dict) -> shardspeed.ShardSpeedEngine:
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=SeqModel(), config=config)
    return engine


def test_forward_gets_curriculum_seqlen_per_global_step_like_deepspeed() -> None:
    engine = _engine(_config())
    _run(engine, 5)
    # difficulty of step global_steps + 1: fixed_linear over 3 steps, 4 -> 16 in multiples of 4; GAS 2: twice each
    want = [8, 8, 12, 12, 16, 16, 16, 16, 16, 16]
    assert engine.module.seen == [(FULL, d) for d in want]
    assert engine.curriculum_enabled_legacy()
    assert engine.curriculum_params_legacy()["schedule_type"] == "fixed_linear"
    assert engine.curriculum_scheduler_legacy.get_current_difficulty() == FULL
    engine.eval()  # evaluation: no curriculum_seqlen, no update
    engine(*_batch(0))
    assert engine.module.seen[-1] == (FULL, None)


def test_truncate_cuts_the_batch_and_equals_the_model_doing_it() -> None:
    a = _engine(_config())
    b = _engine(_config(truncate=True))
    assert _run(a, 4) == pytest.approx(_run(b, 4), rel=0, abs=0)
    assert [n for n, _ in b.module.seen] == [8, 8, 12, 12, 16, 16, 16, 16]
    assert all(s is None for _, s in b.module.seen)


def test_truncate_rule() -> None:
    t2, t3, other, short = torch.zeros(2, 8), torch.zeros(2, 8, 3), torch.zeros(2, 5), torch.zeros(8)
    out = truncate_batch({"a": (t2, [t3, other]), "b": short, "c": 7}, 4, 8)
    assert out["a"][0].shape == (2, 4) and out["a"][1][0].shape == (2, 4, 3)
    assert out["a"][1][1] is other and out["b"] is short and out["c"] == 7


def test_custom_schedule_without_a_function_is_an_error() -> None:
    engine = _engine(_config(schedule_type="custom", schedule_config={}))
    with pytest.raises(Exception, match="set_custom_get_difficulty"):
        engine(*_batch(0))


def test_custom_schedule_function() -> None:
    engine = _engine(_config(schedule_type="custom", schedule_config={}))
    # not the engine's failure: the custom-schedule error above would have marked it failed, so a fresh engine
    engine.curriculum_scheduler_legacy.set_custom_get_difficulty(lambda step: [4, 16, 8][min(step, 2)])
    _run(engine, 3)
    assert [s for _, s in engine.module.seen] == [16, 16, 16, 16, 16, 16]  # 16 at step 1 = max: stays (DeepSpeed)


def test_logged_to_monitor_and_progress_line(tmp_path, caplog) -> None:
    config = _config()
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "cl"}
    engine = _engine(config)
    with caplog.at_level(logging.INFO):
        _run(engine, 3)
    engine.destroy()
    files = list(tmp_path.rglob("*curriculum_seqlen*.csv"))
    assert files, sorted(p.name for p in tmp_path.rglob("*"))
    rows = files[0].read_text().split()
    assert [float(r.split(",")[1]) for r in rows[1:]] == [8.0, 12.0, 16.0]
    assert "step 2: curriculum_seqlen 12" in caplog.text
    assert CURRICULUM_TAG.endswith("curriculum_seqlen")


def test_resume_mid_curriculum_equals_uninterrupted(tmp_path) -> None:
    config = _config(schedule_type="fixed_discrete", schedule_config={"difficulty": [4, 8, 16], "max_step": [2, 4]})
    config["curriculum_learning"]["max_difficulty"] = 16
    whole = _engine(config)
    want = _run(whole, 6)
    first = _engine(config)
    _run(first, 3)
    first.save_checkpoint(str(tmp_path))
    second = _engine(config)
    second.load_checkpoint(str(tmp_path))
    assert second.curriculum_scheduler_legacy.get_current_difficulty() == 8
    assert _run(second, 3, start=3) == pytest.approx(want[3:], rel=0, abs=0)
    assert [s for _, s in second.module.seen] == [s for _, s in whole.module.seen][6:]


def test_bf16_and_tensor_core_warning(caplog) -> None:
    """bf16 beside the curriculum (truncation cuts the integer token tensors, the model runs in bf16), and DeepSpeed's
    warning for a difficulty_step that is not a multiple of 8."""
    config = _config(truncate=True)
    config["bf16"] = {"enabled": True}
    with caplog.at_level(logging.WARNING):
        engine = _engine(config)
    assert "difficulty_step = 4 is not a multiple of 8" in caplog.text
    losses = _run(engine, 3)
    assert [n for n, _ in engine.module.seen] == [8, 8, 12, 12, 16, 16]
    assert all(loss == loss for loss in losses) and engine.module.emb.weight.dtype == torch.bfloat16
