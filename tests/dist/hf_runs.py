"""Shared pieces of the Hugging Face Trainer tests: tiny GPT-2 / LLaMA models, a fixed token dataset, the
TrainingArguments both trainers get, and one Trainer run (plain Trainer or ShardSpeedTrainer) on a forked rank.

The plain reference runs on a world of one with the global micro-batch (``MB`` × 2 ranks): accelerate gives rank r
the batches r, r+2, … of a sequential sampler, so global micro-step k covers the same samples in both runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch.utils.data import SequentialSampler
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from shardspeed.integrations.hf import ShardSpeedTrainer, from_config

SAMPLES, SEQ, VOCAB, MB, GAS, WORLD = 32, 16, 128, 2, 2, 2
STEPS = SAMPLES // (MB * GAS * WORLD)  # one epoch
LR = 1e-3  # Adam's normalized steps amplify rounding differences in near-zero gradients: keep the step small


def tiny_config(kind: str) -> Any:
    if kind == "gpt2":
        return GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
    if kind == "llama":
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=32,
        )
    raise ValueError(kind)


def build_model(kind: str, under_init_with: dict[str, Any] | None = None) -> torch.nn.Module:
    """The model, seeded; with ``under_init_with`` (a stage-3 DeepSpeed config) built under ``zero.Init`` through
    ``from_config`` (no init_fn), which must equal the normal build bitwise."""
    torch.manual_seed(0)
    if under_init_with is not None:
        return from_config(tiny_config(kind), under_init_with)
    return (GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM)(tiny_config(kind))


def dataset(n: int = SAMPLES, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (n, SEQ), generator=g)]


def ds_config(zero: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A DeepSpeed config as HF users write it: batch sizes and clipping left to the TrainingArguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        **extra,
    }


class _Recording:
    """Sequential data (both runs see the same samples) and every micro-step's loss as the Trainer returns it."""

    micro_losses: list[float]

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return SequentialSampler(self.train_dataset)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.micro_losses.append(float(loss))
        return loss


class PlainTrainer(_Recording, Trainer):
    pass


class RecordingShardSpeedTrainer(_Recording, ShardSpeedTrainer):
    pass


def run_trainer(
    rank: int,
    world: int,
    out: str,
    kind: str,
    zero: dict[str, Any] | None,
    *,
    gradient_checkpointing: bool = False,
    optim: str = "adamw_torch",
    max_steps: int = -1,
    save_steps: int | None = None,
    resume: str | None = None,
    evaluate: bool = True,
    save_dir: str | None = None,
    save16_dir: str | None = None,
    extra_config: dict[str, Any] | None = None,
    zero_init: bool = False,
    samples: int = SAMPLES,
    bf16: bool = False,
    weight_decay: float = 0.01,
    learning_rate: float = LR,
    adam_beta2: float = 0.999,
    adam_epsilon: float = 1e-8,
) -> dict[str, Any]:
    """One training run; ``zero=None`` is the plain Trainer. Returns losses, the log, final weights, eval loss."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # accelerate reads torchrun's variables; the harness sets the rest
    transformers.logging.set_verbosity_error()
    config = ds_config(zero, **(extra_config or {})) if zero is not None else None
    model = build_model(kind, config if zero_init else None)
    built_on_meta = all(p.is_meta for p in model.parameters())
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=MB * WORLD // world,
        per_device_eval_batch_size=MB * WORLD // world,
        gradient_accumulation_steps=GAS,
        num_train_epochs=1,
        max_steps=max_steps,
        learning_rate=learning_rate,
        adam_beta2=adam_beta2,
        adam_epsilon=adam_epsilon,
        weight_decay=weight_decay,
        warmup_steps=1,
        max_grad_norm=1.0,
        optim=optim,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing,
        bf16=bf16,
    )
    common = {"model": model, "args": args, "train_dataset": dataset(samples), "eval_dataset": dataset(8, seed=2)}
    if zero is None:
        trainer: Any = PlainTrainer(**common)
    else:
        trainer = RecordingShardSpeedTrainer(**common, shardspeed_config=config)
    trainer.micro_losses = []
    trainer.train(resume_from_checkpoint=resume)
    result: dict[str, Any] = {
        "losses": trainer.micro_losses,
        "log": [h for h in trainer.state.log_history if "loss" in h],
        "eval_loss": trainer.evaluate()["eval_loss"] if evaluate else None,
        "built_on_meta": built_on_meta,
        "compute_dtype": str(trainer.engine.config.compute_dtype) if zero is not None else None,
        "optimizer": (
            {k: v for k, v in trainer.engine.optimizer.param_groups[0].items() if k in ("betas", "eps", "weight_decay")}
            if zero is not None
            else None
        ),
    }
    state = trainer.engine.module_state_dict() if zero is not None else trainer.model.state_dict()
    result["weights"] = {k: v.detach().clone() for k, v in state.items()}
    if save_dir is not None:
        trainer.save_model(save_dir)
    if save16_dir is not None:  # DeepSpeed's save_16bit_model under the name from_pretrained looks for
        trainer.engine.save_16bit_model(save16_dir, "model.safetensors")
        if rank == 0:
            trainer.model.config.save_pretrained(save16_dir)
    return result
