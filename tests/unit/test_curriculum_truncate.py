"""``curriculum_learning.truncate`` (training/curriculum.py): contiguous cuts a ``.view(-1)`` model accepts, masks cut
on every full-length dim, one clear error when nothing matches the full length, and a resume where the saved
difficulty matters (DeepSpeed's sticky rule across the save)."""

from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.config.errors import ConfigError
from shardspeed.training.curriculum import truncate_batch

FULL = 16


class ViewModel(torch.nn.Module):
    """nanoGPT's loss: ``.view(-1)`` on the targets and logits (needs contiguous inputs) and a ``[b, s, s]`` mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)
        self.seen: list[tuple[tuple[int, ...], ...]] = []

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.seen.append((tuple(tokens.shape), tuple(mask.shape)))
        h = self.emb(tokens)
        h = h + (mask.float() @ h) / mask.shape[-1]  # needs mask [b, s, s] with the tokens' s
        logits = h @ self.emb.weight.T
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _config(**section) -> dict:
    cl = {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 4,
        "max_difficulty": FULL,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 4},
        "truncate": True,
        **section,
    }
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 100,
        "curriculum_learning": cl,
    }


def _batch(seed: int, length: int = FULL) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (2, length), generator=g)
    return x, torch.roll(x, -1, dims=1), torch.ones(2, length, length).tril()


def _engine(config: dict) -> shardspeed.ShardSpeedEngine:
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=ViewModel(), config=config)
    return engine


def _run(engine, steps: int, start: int = 0, length: int = FULL) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = engine(*_batch(step, length))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_truncate_with_a_view_model_and_a_square_mask() -> None:
    engine = _engine(_config())
    _run(engine, 4)
    assert engine.module.seen == [((2, d), (2, d, d)) for d in (8, 12, 16, 16)]


def test_truncate_rule_cuts_every_full_dim_contiguously() -> None:
    t2, mask3, mask4, other = torch.zeros(2, 8), torch.zeros(2, 8, 8), torch.zeros(2, 1, 8, 8), torch.zeros(2, 5)
    out = truncate_batch([t2, mask3, mask4, other, torch.zeros(8, 3)], 4, 8)
    assert [tuple(t.shape) for t in out] == [(2, 4), (2, 4, 4), (2, 1, 4, 4), (2, 5), (8, 3)]
    assert all(t.is_contiguous() for t in out) and out[3] is other


def test_nothing_to_cut_is_one_clear_error() -> None:
    engine = _engine(_config(max_difficulty=32, schedule_config={"total_curriculum_step": 3, "difficulty_step": 8}))
    with pytest.raises(ConfigError, match=r"curriculum_learning.max_difficulty = 32.*\[2, 17\]"):
        engine(*_batch(0, length=17))


def test_resume_keeps_the_sticky_difficulty_across_the_save(tmp_path) -> None:
    """custom [4, 16, 8, 8, ...]: 16 = max at step 2 sticks (DeepSpeed); a lost state would drop to 8 after the load."""
    config = _config(schedule_type="custom", schedule_config={}, truncate=True)

    def custom(step: int) -> int:
        return [4, 4, 16, 8][min(step, 3)]

    whole = _engine(config)
    whole.curriculum_scheduler_legacy.set_custom_get_difficulty(custom)
    want = _run(whole, 5)
    assert [s[0][1] for s in whole.module.seen] == [4, 16, 16, 16, 16]
    first = _engine(config)
    first.curriculum_scheduler_legacy.set_custom_get_difficulty(custom)
    _run(first, 2)
    first.save_checkpoint(str(tmp_path))
    second = _engine(config)
    second.curriculum_scheduler_legacy.set_custom_get_difficulty(custom)
    second.load_checkpoint(str(tmp_path))
    assert _run(second, 3, start=2) == pytest.approx(want[2:], rel=0, abs=0)
    assert [s[0][1] for s in second.module.seen] == [16, 16, 16]


def test_min_difficulty_below_one_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"curriculum_learning\.min_difficulty.*at least 1"):
        shardspeed.initialize(model=ViewModel(), config=_config(min_difficulty=0))
