"""Hugging Face GPT-2 and LLaMA built from a small config under ``zero.Init`` with no ``init_fn``.

The reference is always an independent normal build (same seed; fp32, then ``.to(bf16)`` for bf16), compared on the
full gathered state: parameters and every buffer, non-persistent ones included (GPT-2's causal ``attn.bias`` mask
and ``masked_bias``, LLaMA's rotary ``inv_freq``). Training, checkpoints and ``save_16bit_model`` →
``from_pretrained`` are checked against a normal (non-Init) stage-3 build of the same model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"  # configs only, nothing is ever downloaded

import shardspeed  # noqa: E402
from shardspeed import zero  # noqa: E402

VOCAB, SEQ, MB = 64, 8, 2


def _config(kind: str) -> transformers.PretrainedConfig:
    if kind == "gpt2":  # dropout off: training parity compares exact losses
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16,
    )  # fmt: skip


def _build(kind: str, under_init: bool) -> torch.nn.Module:
    config = _config(kind)
    if under_init:
        with zero.Init():
            return transformers.AutoModelForCausalLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def _ds_config(precision: str, offload: bool = False, gather_on_save: bool = False) -> dict:
    zero_section: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero_section["offload_param"] = {"device": "cpu"}
    if gather_on_save:
        zero_section["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero_section,
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1000,
    }


def _full_state(engine: shardspeed.ShardSpeedEngine) -> dict[str, torch.Tensor]:
    """Gathered parameters and persistent buffers, plus non-persistent buffers (never gathered: kept whole)."""
    state = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    for name, buffer in engine.module.named_buffers():
        state.setdefault(name, buffer.detach().clone())
    return state


def _reference_state(kind: str, precision: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(100)
    model = _build(kind, under_init=False)
    after = torch.rand(4)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    state = dict(model.state_dict())
    for name, buffer in model.named_buffers():
        state.setdefault(name, buffer)
    return state, after


def _built_under_init(rank: int, world: int, kind: str, precision: str) -> dict:
    torch.manual_seed(100 + rank)  # ranks draw different numbers: rank 0's must win (broadcast)
    model = _build(kind, under_init=True)
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    engine, *_ = shardspeed.initialize(model=model, config=_ds_config(precision))
    return {"state": _full_state(engine), "rand": torch.rand(4)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_under_init_is_bitwise_a_normal_build(dist_run, kind: str, precision: str) -> None:
    results = dist_run(_built_under_init, 2, kind, precision)
    expected, expected_rand = _reference_state(kind, precision)
    assert any("inv_freq" in n or "attn.bias" in n for n in expected)  # the buffers are compared too
    for r in results:
        assert sorted(r["state"]) == sorted(expected)
        for name, tensor in expected.items():
            assert r["state"][name].dtype == tensor.dtype, name
            assert torch.equal(r["state"][name], tensor), name
    assert torch.equal(results[0]["rand"], expected_rand)  # the generator stands where a normal build leaves it


# --- training ----------------------------------------------------------------------------------------------------


def _batches(steps: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (MB * world, SEQ), generator=g) for _ in range(steps)]


def _engine(kind: str, under_init: bool, precision: str, offload: bool, checkpointing: bool, **kw):
    torch.manual_seed(100)
    model = _build(kind, under_init)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = shardspeed.initialize(model=model, config=_ds_config(precision, offload, **kw))
    return engine


def _train(engine, rank: int, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        ids = batch[rank * MB : (rank + 1) * MB]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train_both(rank: int, world: int, kind: str, precision: str, offload: bool, checkpointing: bool) -> dict:
    batches = _batches(1, world) * 3  # one batch, so the loss must fall
    out = {}
    for under_init in (True, False):
        engine = _engine(kind, under_init, precision, offload, checkpointing)
        out[under_init] = (_train(engine, rank, batches), _full_state(engine))
        engine.destroy()
    return out


def _check_training(results: list[dict]) -> None:
    for r in results:
        (init_losses, init_state), (plain_losses, plain_state) = r[True], r[False]
        assert init_losses == plain_losses
        for name, tensor in plain_state.items():
            assert torch.equal(init_state[name], tensor), name
        assert init_losses[-1] < init_losses[0]


def test_llama_under_init_trains_like_a_normal_stage3_build(dist_run) -> None:
    """Representative of the matrix below: bf16 with parameter offload and gradient checkpointing."""
    _check_training(dist_run(_train_both, 2, "llama", "bf16", True, True))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(("precision", "offload"), [("fp32", False), ("bf16", False), ("bf16", True)])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_under_init_training_matrix(dist_run, kind: str, precision: str, offload: bool, checkpointing: bool):
    _check_training(dist_run(_train_both, 2, kind, precision, offload, checkpointing))


# --- checkpoints and save_16bit_model ----------------------------------------------------------------------------


def _checkpoint_round_trip(rank: int, world: int, kind: str, tmp: str) -> dict:
    batches = _batches(3, world)
    engine = _engine(kind, True, "fp32", False, False)
    _train(engine, rank, batches[:2])
    engine.save_checkpoint(tmp, tag="t")
    continued = _train(engine, rank, batches[2:])
    engine.destroy()
    restored = _engine(kind, True, "fp32", False, False)  # a fresh zero.Init build, then the checkpoint
    restored.load_checkpoint(tmp, tag="t")
    return {"continued": continued, "resumed": _train(restored, rank, batches[2:])}


@pytest.mark.parametrize("kind", ["gpt2"])
def test_checkpoint_round_trip_of_an_init_built_model(dist_run, tmp_path: Path, kind: str) -> None:
    for r in dist_run(_checkpoint_round_trip, 2, kind, str(tmp_path / "ckpt")):
        assert r["resumed"] == r["continued"]


def _save_16bit(rank: int, world: int, kind: str, precision: str, out: str) -> dict:
    engine = _engine(kind, True, precision, False, False, gather_on_save=True)
    _train(engine, rank, _batches(1, world))
    assert engine.save_16bit_model(out, "model.safetensors")  # the name from_pretrained looks for
    if rank == 0:
        engine.module.config.save_pretrained(out)
    return {k: v.float() for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize(("kind", "precision"), [("gpt2", "bf16"), ("llama", "fp32")])
def test_save_16bit_model_reloads_with_from_pretrained(dist_run, tmp_path: Path, kind: str, precision: str) -> None:
    out = str(tmp_path / "hf")
    saved = dist_run(_save_16bit, 2, kind, precision, out)[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=dtype)
    state = reloaded.state_dict()
    assert sorted(state) == sorted(saved)
    for name, tensor in saved.items():
        assert state[name].dtype == dtype, name
        assert torch.equal(state[name].float(), tensor), name
