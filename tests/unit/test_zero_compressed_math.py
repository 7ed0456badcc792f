"""1-bit Adam under ZeRO-1/2, the pure parts: which combinations are refused, the phase rule, the update, the error
buffers' bytes against ZeRO's memory formula, and how loaded error buffers wait for their bucket's compressor."""

from __future__ import annotations

import pytest
import torch

from shardspeed.comm import Work
from shardspeed.config.errors import ConfigError
from shardspeed.zero.compressed_adam import ZeroOneBitAdam, frozen_at, onebit_adam_update
from shardspeed.zero.compressed_grads import (
    GradCompression,
    check_compression_combination,
    error_buffer_bytes,
    zero_memory_bytes,
)
from shardspeed.zero.layout import build_shard_layout


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_combinations(name: str, stage: int) -> None:
    if stage == 0 or (name == "OneBitAdam" and stage in (1, 2)):
        check_compression_combination(name, stage)
        return
    with pytest.raises(ConfigError, match=rf"optimizer {name} with zero_optimization\.stage {stage} is not supported"):
        check_compression_combination(name, stage)


def test_other_optimizers_pass_and_classes_are_named() -> None:
    check_compression_combination("AdamW", 3)
    check_compression_combination(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 3)
    opt = ZeroOneBitAdam([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ConfigError, match=r"OneBitAdam with zero_optimization\.stage 3"):
        check_compression_combination(opt, 3)


def test_phase_follows_deepspeed() -> None:
    """DeepSpeed: step 1 initialises; from step 2 on, ``step >= freeze_step`` at the end of a step freezes the
    variance for the next one (so freeze_step 0, 1 and 2 all compress from step 3)."""
    assert [k for k in range(1, 8) if frozen_at(k, 4)] == [5, 6, 7]
    for f in (0, 1, 2):
        assert [k for k in range(1, 6) if frozen_at(k, f)] == [3, 4, 5]


def test_update_matches_deepspeed_formula() -> None:
    g = torch.randn(20, generator=torch.Generator().manual_seed(0))
    p, m, v = torch.ones(20), torch.full((20,), 0.1), torch.full((20,), 0.2)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    onebit_adam_update(p, g, m, v, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, frozen=False)
    m1, v1 = 0.9 * m0 + 0.1 * g, 0.99 * v0 + 0.01 * g * g
    torch.testing.assert_close(p, p0 - 0.01 * (m1 / (v1.sqrt() + 1e-8) + 0.1 * p0))
    onebit_adam_update(p, g, m, v, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, frozen=True)
    torch.testing.assert_close(v, v1)  # frozen
    torch.testing.assert_close(m, 0.9 * m1 + 0.1 * g)


def test_first_step_only_counts() -> None:
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = ZeroOneBitAdam([p], lr=0.1, freeze_step=3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and opt.steps == 1
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_error_buffers_are_4_bytes_per_element_against_the_zero_formula(world: int) -> None:
    numels = [1000, 37, 4096, 3, 250_000]
    layout = build_shard_layout(numels, [0] * len(numels), 50_000, world)
    psi = sum(numels)
    err = error_buffer_bytes(layout)
    assert 4 * psi <= err <= 4 * (layout.total + 8 * world * len(layout.buckets))  # padding only
    # stage 2 with mixed precision: 2Ψ + 14Ψ/N without compression; the error buffers add about 4Ψ
    base = zero_memory_bytes(psi, world, 2, mixed=True)
    assert base == 2 * psi + 14 * psi // world
    assert (base + err) / base == pytest.approx(1 + 4 / (2 + 14 / world), rel=1e-3)
    assert zero_memory_bytes(psi, world, 1, mixed=True) == 4 * psi + 12 * psi // world


class _Fake:
    def __init__(self, numel: int, *_: object) -> None:
        self.worker_error = torch.zeros(numel)
        self.error_bytes = 4 * numel

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"worker_error": self.worker_error}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.worker_error.copy_(sd["worker_error"])

    def reset(self) -> None:
        self.worker_error.zero_()


def test_loaded_error_buffers_wait_for_their_compressor() -> None:
    """[Note: error buffers and the re-layout]: loaded before the re-layout, used after it."""
    gc = GradCompression(None, None, torch.device("cpu"), _Fake)  # type: ignore[arg-type]
    before = build_shard_layout([4, 6], [0, 0], 100, 2)
    after = build_shard_layout([4, 6], [0, 0], 100, 2, order=[1, 0])
    gc.bind(before)
    gc.load_state_dict({"bucket0.worker_error": torch.arange(10.0)})
    assert gc.error_bytes == 0 and set(gc.state_dict()) == {"bucket0.worker_error"}  # saved again as loaded
    gc.bind(after)
    assert torch.equal(gc.compressor(0).worker_error, torch.arange(10.0))
    gc.reset()
    assert gc.state_dict()["bucket0.worker_error"].count_nonzero() == 0


class _Compressing(_Fake):
    """Compresses the whole input with compression/'s ``compress_`` into its worker error; returns slice 0."""

    def launch(self, shard: torch.Tensor, unsharded: torch.Tensor) -> Work:
        from shardspeed.compression.signs import compress_

        compress_(unsharded.clone(), self.worker_error)
        shard.copy_(unsharded[: shard.numel()])
        return Work(None)


class _Axis:
    size = 2


def _compression(scale: float) -> GradCompression:
    gc = GradCompression(_Axis(), None, torch.device("cpu"), _Compressing)  # type: ignore[arg-type]
    gc.bind(build_shard_layout([16], [0], 100, 2))
    gc.loss_scale = lambda: scale
    return gc


def test_error_lives_in_gradient_units_and_the_output_is_scaled_back() -> None:
    """[Note: transactional error]: the bucket is divided by the loss scale before compression, the reduced slice
    multiplied back; the residual is the same whatever the loss scale."""
    g = torch.randn(16, generator=torch.Generator().manual_seed(1))
    plain, scaled = _compression(1.0), _compression(1024.0)
    plain.launch(0, g.clone())
    _, out, _ = scaled.launch(0, g * 1024.0)
    scaled.finish(0, out)
    torch.testing.assert_close(scaled.compressor(0).worker_error, plain.compressor(0).worker_error)
    torch.testing.assert_close(out, g[:8] * 1024.0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_bucket_leaves_the_error_as_it_was(bad: float) -> None:
    """[Note: transactional error]: an fp16 overflow must not poison the error for good."""
    gc = _compression(256.0)
    g = torch.randn(16, generator=torch.Generator().manual_seed(2))
    gc.launch(0, g * 256.0)
    kept = gc.compressor(0).worker_error.clone()
    assert kept.count_nonzero() > 0
    g[3] = bad
    _, out, _ = gc.launch(0, g * 256.0)
    gc.finish(0, out)
    assert torch.equal(gc.compressor(0).worker_error, kept)
    assert not torch.isfinite(out).all()  # the overflow reaches the engine's check


@pytest.mark.parametrize("opt_type,stage", [("OneBitLamb", 2), ("ZeroOneAdam", 1), ("OneBitAdam", 3)])
def test_refused_before_any_collective(monkeypatch: pytest.MonkeyPatch, opt_type: str, stage: int) -> None:
    """Review C #9: the refusal comes before the engine builds its collectives (so before any collective runs)."""
    import shardspeed
    import shardspeed.engine

    def no_collectives(*_: object, **__: object) -> None:
        raise AssertionError("the engine built its collectives before refusing the combination")

    monkeypatch.setattr(shardspeed.engine, "engine_collectives", no_collectives)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": opt_type, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    with pytest.raises(ConfigError, match=rf"optimizer {opt_type} with zero_optimization\.stage {stage}"):
        shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
