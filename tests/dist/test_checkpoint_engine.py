"""Engine checkpoints: exact resume (stages 0-3, fp32/bf16), resharding across stage and world size, kill -9
during a save, corrupted files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import IN, OUT, make_model

import shardspeed
from harness import RankFailure

GLOBAL_BATCH, MB = 8, 2


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, IN, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(IN, OUT, generator=g)))


def _engine(stage: int, world: int, bf16: bool = False, model_kwargs: dict | None = None):
    model = make_model(**(model_kwargs or {}))
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.01}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine, _, loader, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=_dataset(), config=config
    )
    return engine, loader


def _train(engine, loader, steps: int, noise: bool) -> None:
    dtype = next(iter(engine.module.parameters())).dtype
    batches = iter(shardspeed.RepeatingLoader(loader))
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        if noise:  # consumes the global RNG every step: resume must restore it exactly
            x = x + 0.01 * torch.randn_like(x)
        engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
        engine.step()


def _run(
    rank: int,
    world: int,
    stage: int,
    steps: int,
    save_to: str | None,
    load_from: str | None,
    bf16: bool,
    noise: bool = True,
) -> dict:
    engine, loader = _engine(stage, world, bf16)
    if load_from is not None:
        path, client = engine.load_checkpoint(load_from)
        assert path is not None and client == {"note": "hello", "step": 5}
    _train(engine, loader, steps, noise)
    if save_to is not None:
        engine.save_checkpoint(save_to, client_state={"note": "hello", "step": engine.global_steps})
    return {k: v.float() for k, v in engine.module_state_dict().items()} | {"_steps": engine.global_steps}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_equals_uninterrupted(dist_run, tmp_path: Path, stage: int, bf16: bool) -> None:
    full = dist_run(_run, 2, stage, 10, None, None, bf16)
    dist_run(_run, 2, stage, 5, str(tmp_path / "ckpt"), None, bf16)
    resumed = dist_run(_run, 2, stage, 5, None, str(tmp_path / "ckpt"), bf16)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step5"
    for a, b in zip(full, resumed):
        assert b["_steps"] == 10
        for name in a:
            if name != "_steps":
                assert (a[name] - b[name]).abs().max().item() <= 1e-6, name


RESHARD = [((3, 2), (0, 1)), ((3, 2), (2, 2)), ((3, 2), (3, 4)), ((1, 4), (0, 1)), ((1, 4), (2, 2)), ((1, 4), (3, 4))]


@pytest.mark.parametrize(("saved", "loaded"), RESHARD)
def test_reshard_across_stage_and_world(dist_run, tmp_path: Path, saved: tuple, loaded: tuple) -> None:
    (s_stage, s_world), (l_stage, l_world) = saved, loaded
    reference = dist_run(_run, 2, 0, 10, None, None, False, False)[0]
    dist_run(_run, s_world, s_stage, 5, str(tmp_path / "ckpt"), None, False, False)
    for r in dist_run(_run, l_world, l_stage, 5, None, str(tmp_path / "ckpt"), False, False):
        for name in reference:
            if name != "_steps":
                assert (reference[name] - r[name]).abs().max().item() <= 1e-5, (name, saved, loaded)


def _save_twice_dying(rank: int, world: int, where: str) -> None:
    engine, loader = _engine(2, world)
    _train(engine, loader, 2, False)
    engine.save_checkpoint(where, tag="first", client_state={"note": "hello", "step": 5})
    _train(engine, loader, 1, False)
    os.environ["SHARDSPEED_INJECT"] = "checkpoint_write:kill:rank=1:after=1"  # SIGKILL at rank 1's second write
    engine.save_checkpoint(where, tag="second")


def _resume_and_save_again(rank: int, world: int, where: str) -> int:
    result = _run(rank, world, 2, 1, None, where, False, False)
    engine, _ = _engine(2, world)
    engine.save_checkpoint(where, tag="second")  # the tag the killed save was writing
    return result["_steps"]


def test_kill_9_during_save_keeps_previous_checkpoint(dist_run, tmp_path: Path) -> None:
    where = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure):
        dist_run(_save_twice_dying, 2, where)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "first"
    assert not (tmp_path / "ckpt" / "second").exists()
    assert len(list((tmp_path / "ckpt").glob(".tmp-second-*"))) == 1  # the killed save's files: never loaded
    assert dist_run(_resume_and_save_again, 2, where) == [3, 3]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "second"
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))  # committing the tag removed the killed save's directory


def _load_expect_error(rank: int, world: int, where: str) -> str:
    engine, _ = _engine(0, world)
    with pytest.raises(Exception) as info:
        engine.load_checkpoint(where)
    return str(info.value)


def test_corrupted_or_truncated_file_is_named(dist_run, tmp_path: Path) -> None:
    where = tmp_path / "ckpt"
    dist_run(_run, 2, 1, 2, str(where), None, False, False)
    files = sorted((where / "global_step2").glob("*.safetensors"))
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # flip a byte inside the last tensor's data
    victim.write_bytes(bytes(data))
    for message in dist_run(_load_expect_error, 2, str(where)):
        assert victim.name in message
    victim.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    for message in dist_run(_load_expect_error, 2, str(where)):
        assert victim.name in message


def test_missing_checkpoint_returns_none(dist_run, tmp_path: Path) -> None:
    def probe(rank: int, world: int, where: str) -> tuple:
        engine, _ = _engine(0, world)
        return engine.load_checkpoint(where)

    assert dist_run(probe, 2, str(tmp_path / "nothing")) == [(None, None), (None, None)]


def test_client_state_must_be_plain_data(dist_run, tmp_path: Path) -> None:
    def save_object(rank: int, world: int, where: str) -> str:
        engine, _ = _engine(0, world)
        with pytest.raises(TypeError) as info:
            engine.save_checkpoint(where, client_state={"obj": object()})
        return str(info.value)

    for message in dist_run(save_object, 2, str(tmp_path / "ckpt")):
        assert "client_state must be plain data" in message


def _stage3_save_and_state(rank: int, world: int, where: str) -> dict:
    engine, loader = _engine(3, world, model_kwargs={"tied": True})
    _train(engine, loader, 2, False)
    engine.save_checkpoint(where)
    return engine.module_state_dict()


def _load_stats(rank: int, world: int, where: str) -> dict:
    engine, _ = _engine(3, world, model_kwargs={"tied": True})
    engine.load_checkpoint(where)
    return engine.last_load_stats


def test_consolidation_equals_model_and_ranks_read_only_their_part(dist_run, tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    from shardspeed.launcher.cli import main
    from shardspeed.utils import get_fp32_state_dict_from_zero_checkpoint

    where = tmp_path / "ckpt"
    state = dist_run(_stage3_save_and_state, 2, str(where))[0]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(where))
    assert set(consolidated) == set(state)  # tied alias included
    for name, value in state.items():
        assert torch.equal(consolidated[name], value), name
    assert main(["zero-to-fp32", str(where), str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name
    # with tiny chunks, each of 2 ranks reads only the chunks overlapping its shards
    index = json.loads((where / "global_step2" / "index.json").read_text())
    total = sum(len(t["chunks"]) for n, t in index["tensors"].items() if not n.startswith("buffer/"))
    for stats in dist_run(_load_stats, 2, str(where)):
        assert 0 < stats["chunks_read"] < total
