"""The Hugging Face Trainer trains through shardspeed (``ShardSpeedTrainer``) on 2 gloo ranks exactly as the plain
Trainer does on one process: per-micro-step losses, logged loss / learning rate / grad norm, final weights and the
eval loss, at ZeRO 0-3 (3 with parameter offload and gradient checkpointing), for GPT-2 and LLaMA; checkpoint and
resume equals an uninterrupted run; ``save_model`` and ``save_16bit_model`` reload with ``from_pretrained``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from hf_runs import GAS, STEPS, WORLD, run_trainer

from harness import run_ranks

TOL = 1e-5
_REFERENCES: dict[tuple[Any, ...], dict[str, Any]] = {}


def _reference(
    tmp_path_factory: pytest.TempPathFactory, kind: str, optim: str = "adamw_torch", **kwargs: Any
) -> dict[str, Any]:
    """The plain Trainer on a world of one (cached per model and settings: every stage compares to it)."""
    key = (kind, optim, *sorted(kwargs.items()))
    if key not in _REFERENCES:
        out = tmp_path_factory.mktemp(f"ref-{kind}-{optim}")
        (_REFERENCES[key],) = run_ranks(run_trainer, 1, out, str(out / "run"), kind, None, optim=optim, **kwargs)
    return _REFERENCES[key]


def _check_parity(ref: dict[str, Any], ranks: list[dict[str, Any]], steps: int = STEPS) -> None:
    # Each rank's loss is its share of the window's token-mean (the Trainer normalizes by the global token count
    # and multiplies by the world size), so the rank mean is the single-process loss of the same samples.
    per_rank = [r["losses"] for r in ranks]
    assert len(per_rank[0]) == len(ref["losses"]) >= steps * GAS - 1
    mean = [sum(values) / WORLD for values in zip(*per_rank)]
    assert max(abs(a - b) for a, b in zip(mean, ref["losses"])) <= TOL, (mean, ref["losses"])
    log, ref_log = ranks[0]["log"], ref["log"]
    assert [h["step"] for h in log] == [h["step"] for h in ref_log] == list(range(1, steps + 1))
    for got, want in zip(log, ref_log):
        assert got["learning_rate"] == pytest.approx(want["learning_rate"], abs=1e-12)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
        assert abs(got["loss"] - want["loss"]) <= 1e-4  # the Trainer logs round(loss, 4)
    weights, ref_weights = ranks[0]["weights"], ref["weights"]
    assert weights.keys() == ref_weights.keys()
    for name, value in weights.items():
        assert (value.float() - ref_weights[name]).abs().max().item() <= TOL, name
    for r in ranks[1:]:  # every rank gathers the same model
        assert all(torch.equal(r["weights"][k], weights[k]) for k in weights)
    assert ranks[0]["eval_loss"] == pytest.approx(ref["eval_loss"], abs=TOL)


CASES = [
    pytest.param("gpt2", {"stage": 0}, False, id="gpt2-zero0", marks=pytest.mark.slow),
    # default suite: stage 2 runs in test_config_optimizer_filled_from_the_training_arguments, stage 3 with
    # gradient checkpointing in test_trainer_trains_a_model_built_under_zero_init
    pytest.param("gpt2", {"stage": 2}, False, id="gpt2-zero2", marks=pytest.mark.slow),
    pytest.param("llama", {"stage": 3}, True, id="llama-zero3-gc", marks=pytest.mark.slow),
    pytest.param("gpt2", {"stage": 1}, False, id="gpt2-zero1", marks=pytest.mark.slow),
    pytest.param("gpt2", {"stage": 3}, False, id="gpt2-zero3", marks=pytest.mark.slow),
    pytest.param("gpt2", {"stage": 3}, True, id="gpt2-zero3-gc", marks=pytest.mark.slow),
    pytest.param(
        "gpt2",
        {"stage": 3, "offload_param": {"device": "cpu"}},
        True,
        id="gpt2-zero3-offload-gc",
        marks=pytest.mark.slow,
    ),
    pytest.param("llama", {"stage": 0}, False, id="llama-zero0", marks=pytest.mark.slow),
    pytest.param("llama", {"stage": 3}, False, id="llama-zero3", marks=pytest.mark.slow),
    pytest.param(
        "llama",
        {"stage": 3, "offload_param": {"device": "cpu"}},
        True,
        id="llama-zero3-offload-gc",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "llama",
        {"stage": 3, "offload_param": {"device": "cpu"}},
        False,
        id="llama-zero3-offload",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("kind", "zero", "gc"), CASES)
def test_trainer_matches_plain_trainer(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, kind: str, zero: dict, gc: bool
) -> None:
    ref = _reference(tmp_path_factory, kind)
    ranks = run_ranks(run_trainer, WORLD, tmp_path, str(tmp_path / "run"), kind, zero, gradient_checkpointing=gc)
    _check_parity(ref, ranks)


HF_STYLE_OPTIMIZER = {  # as in transformers' DeepSpeed docs: every value "auto"
    "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
}


def test_config_optimizer_filled_from_the_training_arguments(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A config with its own optimizer section, all "auto": the engine builds it with the TrainingArguments' lr /
    betas / eps / weight decay — the plain Trainer's AdamW (weight decay 0: a config optimizer has no per-parameter
    decay groups) — and the Trainer's linear warmup schedule drives it. (A config ``scheduler`` is DeepSpeed's own
    curve — WarmupDecayLR warms up over at least 2 steps — so it is not compared with the Trainer's.)"""
    # values other than every default, so "auto" that fell back to a default would show
    hyper = {"weight_decay": 0.0, "learning_rate": 2e-3, "adam_beta2": 0.99, "adam_epsilon": 1e-7}
    ref = _reference(tmp_path_factory, "gpt2", **hyper)
    ranks = run_ranks(
        run_trainer,
        WORLD,
        tmp_path,
        str(tmp_path / "run"),
        "gpt2",
        {"stage": 2},
        extra_config=HF_STYLE_OPTIMIZER,
        **hyper,
    )
    _check_parity(ref, ranks)
    assert ref["log"][1]["learning_rate"] == 2e-3  # the warmup reached the TrainingArguments' rate
    for r in ranks:
        assert r["optimizer"] == {"betas": (0.9, 0.99), "eps": 1e-7, "weight_decay": 0.0}, r["optimizer"]


INIT_CASES = [
    pytest.param("llama", {"stage": 3}, True, id="llama-gc"),
    pytest.param("gpt2", {"stage": 3}, True, id="gpt2-gc", marks=pytest.mark.slow),
    pytest.param("llama", {"stage": 3}, False, id="llama", marks=pytest.mark.slow),
    pytest.param(
        "llama", {"stage": 3, "offload_param": {"device": "cpu"}}, True, id="llama-offload-gc", marks=pytest.mark.slow
    ),
    pytest.param(
        "gpt2", {"stage": 3, "offload_param": {"device": "cpu"}}, False, id="gpt2-offload", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("kind", "zero", "gc"), INIT_CASES)
def test_trainer_trains_a_model_built_under_zero_init(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, kind: str, zero: dict, gc: bool
) -> None:
    """``from_config`` under ``zero.Init`` (no init_fn, never whole on a rank) through the Trainer equals the plain
    Trainer on a normally built model: same initial weights bitwise, so the same losses and final weights."""
    ref = _reference(tmp_path_factory, kind)
    ranks = run_ranks(
        run_trainer, WORLD, tmp_path, str(tmp_path / "run"), kind, zero, gradient_checkpointing=gc, zero_init=True
    )
    assert all(r["built_on_meta"] for r in ranks)  # no rank ever held the model whole
    _check_parity(ref, ranks)


def _evaluate_untrained_init_model(rank: int, world: int, out: str) -> str:
    from hf_runs import RecordingShardSpeedTrainer, build_model, dataset, ds_config
    from transformers import TrainingArguments

    from harness import error_of

    config = ds_config({"stage": 3})
    args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True, disable_tqdm=True)
    model = build_model("gpt2", config)
    trainer = RecordingShardSpeedTrainer(model=model, args=args, eval_dataset=dataset(4), shardspeed_config=config)
    return error_of(trainer.evaluate)


def test_evaluating_an_untrained_zero_init_model_is_a_clear_error(tmp_path: Path) -> None:
    (message,) = run_ranks(_evaluate_untrained_init_model, 1, tmp_path, str(tmp_path / "run"))
    assert message.startswith("RuntimeError") and "zero.Init" in message and "train()" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_trainer_matches_plain_trainer_with_sgd(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stage: int
) -> None:
    ref = _reference(tmp_path_factory, "gpt2", optim="sgd")
    ranks = run_ranks(run_trainer, WORLD, tmp_path, str(tmp_path / "run"), "gpt2", {"stage": stage}, optim="sgd")
    _check_parity(ref, ranks)


def _assert_reloads(directory: Path, kind: str, weights: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert reloaded.keys() == weights.keys()
    for name, value in reloaded.items():
        assert torch.equal(value, weights[name].to(value.dtype)), name


@pytest.mark.parametrize(
    ("kind", "zero", "zero_init"),
    [
        pytest.param("gpt2", {"stage": 3}, False, id="gpt2-zero3"),
        pytest.param("llama", {"stage": 2}, False, id="llama-zero2", marks=pytest.mark.slow),
        pytest.param(
            "llama", {"stage": 3, "offload_param": {"device": "cpu"}}, False, id="llama-offload", marks=pytest.mark.slow
        ),
        pytest.param("llama", {"stage": 3}, True, id="llama-zero-init", marks=pytest.mark.slow),
        pytest.param("gpt2", {"stage": 3}, True, id="gpt2-zero-init", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_resume_and_from_pretrained(tmp_path: Path, kind: str, zero: dict, zero_init: bool) -> None:
    """Trainer checkpoints (saved every 2 steps) hold the engine's checkpoint; resuming from the first one gives the
    uninterrupted run's remaining losses and final weights; ``save_model`` and ``save_16bit_model`` reload with
    ``from_pretrained`` to the trained weights."""
    zero = {**zero, "stage3_gather_16bit_weights_on_model_save": True}
    first = run_ranks(
        run_trainer,
        WORLD,
        tmp_path,
        str(tmp_path / "a"),
        kind,
        zero,
        save_steps=2,
        evaluate=False,
        save_dir=str(tmp_path / "saved"),
        save16_dir=str(tmp_path / "saved16"),
        zero_init=zero_init,
    )
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert {"latest", "global_step2", "model.safetensors", "trainer_state.json"} <= set(os.listdir(checkpoint))
    resumed = run_ranks(
        run_trainer,
        WORLD,
        tmp_path,
        str(tmp_path / "b"),
        kind,
        zero,
        resume=str(checkpoint),
        evaluate=False,
        save_steps=2,
        zero_init=zero_init,
    )
    for whole, tail in zip(first, resumed):
        assert tail["losses"] == whole["losses"][2 * GAS :]
        # the resumed log is the checkpoint's (steps 1-2) continued by the new steps
        assert [(h["step"], h["loss"], h["learning_rate"]) for h in tail["log"]] == [
            (h["step"], h["loss"], h["learning_rate"]) for h in whole["log"]
        ]
        for name, value in tail["weights"].items():
            assert torch.equal(value, whole["weights"][name]), name
    _assert_reloads(tmp_path / "saved", kind, first[0]["weights"])
    _assert_reloads(tmp_path / "saved16", kind, first[0]["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_short_last_accumulation_window_steps_like_the_trainer(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stage: int
) -> None:
    """36 samples = 9 global micro-batches at GAS 2: the epoch ends in a window of one micro-batch, which the Trainer
    steps (its boundary, not the engine's count, decides) with the loss normalized over that shorter window."""
    ref = _reference(tmp_path_factory, "gpt2", samples=36)
    ranks = run_ranks(run_trainer, WORLD, tmp_path, str(tmp_path / "run"), "gpt2", {"stage": stage}, samples=36)
    _check_parity(ref, ranks, steps=5)


@pytest.mark.slow
def test_bf16_from_the_training_arguments(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``bf16=True`` in the TrainingArguments fills ``"bf16": {"enabled": "auto"}``: the engine trains in bf16 and its
    losses track the fp32 plain Trainer's; ``save_model`` and ``save_16bit_model`` hold the bf16 weights exactly."""
    ref = _reference(tmp_path_factory, "gpt2")
    ranks = run_ranks(
        run_trainer,
        WORLD,
        tmp_path,
        str(tmp_path / "run"),
        "gpt2",
        {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        bf16=True,
        extra_config={"bf16": {"enabled": "auto"}},
        save_dir=str(tmp_path / "saved"),
        save16_dir=str(tmp_path / "saved16"),
    )
    assert all(r["compute_dtype"] == "torch.bfloat16" for r in ranks)
    assert all(v.dtype == torch.bfloat16 for v in ranks[0]["weights"].values())
    mean = [sum(values) / WORLD for values in zip(*(r["losses"] for r in ranks))]
    assert max(abs(a - b) for a, b in zip(mean, ref["losses"])) < 0.05
    _assert_reloads(tmp_path / "saved", "gpt2", ranks[0]["weights"])  # bf16 values, exactly
    _assert_reloads(tmp_path / "saved16", "gpt2", ranks[0]["weights"])
