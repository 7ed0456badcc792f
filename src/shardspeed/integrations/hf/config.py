"""``"auto"`` values of a DeepSpeed JSON filled from ``TrainingArguments``, the way transformers does it.

transformers' ``HfTrainerDeepSpeedConfig`` (``trainer_config_process`` + ``trainer_config_finalize``) is the
reference: the same keys, the same sources, the same rule for values that are not ``"auto"`` — they must agree with
the TrainingArguments, or the run stops with a list of every mismatch (a config silently overriding the command
line, or the reverse, is how runs train with the wrong learning rate). Pure: a dict in, a new dict out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"


@dataclass(frozen=True)
class TrainerValues:
    """What the config is filled from: the TrainingArguments' fields plus what the Trainer computes."""

    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: float
    learning_rate: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    weight_decay: float
    fp16: bool
    bf16: bool
    num_training_steps: int
    warmup_steps: int
    hidden_size: int | None = None

    @classmethod
    def from_args(
        cls, args: Any, num_training_steps: int, hidden_size: int | None, max_grad_norm: float | None = None
    ) -> TrainerValues:
        """``max_grad_norm``: the value to clip with when ``args.max_grad_norm`` was switched off for the loop."""
        return cls(
            world_size=args.world_size,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_grad_norm=args.max_grad_norm if max_grad_norm is None else max_grad_norm,
            learning_rate=args.learning_rate,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_epsilon=args.adam_epsilon,
            weight_decay=args.weight_decay,
            fp16=bool(args.fp16 or args.fp16_full_eval),
            bf16=bool(args.bf16 or args.bf16_full_eval),
            num_training_steps=num_training_steps,
            warmup_steps=args.get_warmup_steps(num_training_steps),
            hidden_size=hidden_size,
        )


@dataclass
class _Filler:
    config: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)

    def _find(self, dotted: str) -> tuple[dict[str, Any] | None, str]:
        *parents, leaf = dotted.split(".")
        node: Any = self.config
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def is_auto(self, dotted: str) -> bool:
        node, leaf = self._find(dotted)
        return node is not None and node.get(leaf) == AUTO

    def fill(self, dotted: str, value: Any, source: str | None) -> None:
        """``"auto"`` → ``value``. With a ``source`` (a TrainingArguments name), a set value must equal it."""
        node, leaf = self._find(dotted)
        if node is None or leaf not in node:
            return  # a key the config does not name keeps shardspeed's default, as in transformers
        current = node[leaf]
        if current == AUTO:
            node[leaf] = value
        elif source is not None and not _same(current, value):
            self.mismatches.append(f"- ds {dotted}={current} vs hf {source}={value}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def fill_auto(ds_config: dict[str, Any], hf: TrainerValues) -> dict[str, Any]:
    """A copy of ``ds_config`` with every ``"auto"`` transformers fills replaced by the Trainer's value.

    Raises ValueError listing every non-``"auto"`` value that disagrees with the TrainingArguments. ``"auto"``
    left elsewhere is resolved by shardspeed's config loader (dropped: the default applies, batch sizes inferred).
    """
    f = _Filler(copy.deepcopy(ds_config))
    micro, gas = hf.per_device_train_batch_size, hf.gradient_accumulation_steps
    f.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    f.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.fill("train_batch_size", hf.world_size * micro * gas, "train_batch_size (calculated)")
    f.fill("gradient_clipping", hf.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", hf.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [hf.adam_beta1, hf.adam_beta2], "adam_beta1+adam_beta2")
    f.fill("optimizer.params.eps", hf.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", hf.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0, None)
    f.fill("scheduler.params.warmup_max_lr", hf.learning_rate, "learning_rate")
    f.fill("scheduler.params.total_num_steps", hf.num_training_steps, "num_training_steps (calculated)")
    f.fill("scheduler.params.warmup_num_steps", hf.warmup_steps, "warmup_steps")
    f.fill("fp16.enabled", hf.fp16, "fp16|fp16_full_eval")
    f.fill("bf16.enabled", hf.bf16, "bf16|bf16_full_eval")
    hidden_keys = (
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    )
    wanted = [k for k in hidden_keys if f.is_auto(k)]
    if wanted and hf.hidden_size is None:
        raise ValueError(
            f'the DeepSpeed config sets {", ".join(wanted)} to "auto", which is derived from the model\'s '
            "hidden_size, but the model's config has none; set these keys to numbers"
        )
    if hf.hidden_size is not None:
        h = hf.hidden_size
        f.fill(hidden_keys[0], h * h, None)
        f.fill(hidden_keys[1], int(0.9 * h * h), None)
        f.fill(hidden_keys[2], 10 * h, None)
    if f.mismatches:
        raise ValueError(
            "these DeepSpeed config values disagree with the TrainingArguments:\n"
            + "\n".join(f.mismatches)
            + '\nset them to "auto" (filled from the TrainingArguments) or make them agree'
        )
    return f.config


def model_hidden_size(model: Any) -> int | None:
    """The hidden size transformers reads for the ``"auto"`` bucket sizes (largest of ``hidden_sizes``)."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None) is not None:
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None
