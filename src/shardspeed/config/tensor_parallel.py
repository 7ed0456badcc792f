"""``tensor_parallel``: DeepSpeed 0.19's AutoTP training section, typed (DeepSpeed's ``TPTrainingConfig``).

AutoTP slices an existing model's linear layers over the tensor axis (``tensor_parallel/autotp.py``): which layers
and how comes from ``partition_config.layer_specs`` (regex patterns → column / row / skip), else the model's own
Hugging Face ``base_model_tp_plan``, else ``preset_model`` (or the model's ``config.model_type`` when it names a
preset). ``autotp_size`` 0 or 1 leaves the model whole, as in DeepSpeed.

Keys DeepSpeed keeps here for its *inference* AutoTP parser (``tensor_parallel.tp_size``, ``tp_grain_size``,
``replace_with_kernel_inject``, ``injection_policy_tuple``) either do nothing in DeepSpeed's training path either
(warned) or need inference kernels / Python objects a JSON config cannot carry (refused); config/effects.py says
which.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from .base import ConfigModel, Int, InvalidValue, NonNegativeInt, PositiveInt

AUTOTP_PRESETS: tuple[str, ...] = ("gpt2", "llama", "mistral", "qwen2")
"""Presets shardspeed ships (``tensor_parallel/hf_plans.py``; a unit test keeps the two lists equal)."""

DEEPSPEED_PRESETS_NOT_SHIPPED: tuple[str, ...] = ("bloom", "chatglm", "mixtral", "deepseek_v2", "phi3")
"""DeepSpeed 0.19 presets whose layers need unequal fused parts, experts or MLA (not sliced here yet)."""


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _listlike_to_tuple(value: Any) -> Any:
    """JSON lists arrive as lists; the section is frozen, so store tuples (nested ones too)."""
    if isinstance(value, list):
        return tuple(_listlike_to_tuple(v) for v in value)
    return value


ShapeEntry = int | tuple[int, ...]


class LayerSpecConfig(ConfigModel):
    """One entry of ``partition_config.layer_specs`` (DeepSpeed's ``TPLayerSpec``)."""

    patterns: Annotated[tuple[str, ...], BeforeValidator(_listlike_to_tuple)]
    """Regular expressions, each ``re.match``-ed against a layer's weight name (``model.layers.0.mlp.up_proj.weight``)
    or its module name (``...up_proj``): either form of DeepSpeed's examples works."""

    partition_type: Annotated[Literal["column", "row", "skip"], BeforeValidator(_lower)] = "column"
    """column: split the output features; row: split the input features; skip: leave the layer whole
    (replicated). DeepSpeed default: column."""

    shape: Annotated[tuple[ShapeEntry, ...] | None, BeforeValidator(_listlike_to_tuple)] = None
    """A fused layer's logical shape: ``[k, -1]`` with ``partition_dim`` 0 is k equal fused blocks (QKV: 3,
    gate_up: 2), each split separately. Unequal blocks (a nested list) and reshapes to more dims are refused."""

    partition_dim: Int | None = None
    """The dim split, in nn.Linear's ``[out, in]`` layout: 0 for column (the default), 1 for row (the default)."""

    model_types: Annotated[tuple[str, ...] | None, BeforeValidator(_listlike_to_tuple)] = None
    """Apply only when the model's ``config.model_type`` is one of these (case-insensitive)."""

    gather_output: bool = False
    """Column only: all-gather the output so every tensor rank gets all features (an untied LM head)."""

    grad_allreduce: bool = False
    """Skip only, in DeepSpeed: a replicated layer whose gradient is partial over the tensor axis. Refused here
    for now (no spec provider for an arbitrary module yet)."""

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        if not patterns:
            raise ValueError("a layer spec needs at least one pattern")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"pattern {pattern!r} is not a regular expression: {error}") from None
        return patterns

    @model_validator(mode="after")
    def _consistent(self) -> LayerSpecConfig:
        kind = self.partition_type
        natural = 0 if kind == "column" else 1
        if self.partition_dim is not None and kind != "skip" and self.partition_dim != natural:
            raise InvalidValue(
                "partition_dim",
                f'"{{path}}" = {self.partition_dim} with partition_type "{kind}": a {kind}-parallel layer splits '
                f"dim {natural} of nn.Linear's [out, in] weight; other dims are not supported",
            )
        if self.gather_output and kind != "column":
            raise InvalidValue("gather_output", f'"{{path}}" applies to column layers only, not "{kind}"')
        if self.grad_allreduce:
            raise InvalidValue(
                "grad_allreduce",
                '"{path}" = true is a DeepSpeed option shardspeed does not support yet (replicated layers with '
                "partial gradients outside its own tensor-parallel layers); remove it",
            )
        if self.shape is not None:
            self.fused_parts()  # validates
        return self

    def fused_parts(self) -> int:
        """The number of equal fused blocks along the split dim (1 without ``shape``)."""
        if self.shape is None:
            return 1
        dim = self.partition_dim if self.partition_dim is not None else (0 if self.partition_type == "column" else 1)
        entries = self.shape
        if len(entries) != 2 or any(isinstance(e, tuple) for e in entries):
            raise InvalidValue(
                "shape",
                f'"{{path}}" = {list(entries)}: shardspeed supports [k, -1] (column) or [-1, k] (row), k equal '
                "fused blocks; unequal blocks (a nested list) and reshapes to other ranks are not supported yet",
            )
        parts, other = entries[dim], entries[1 - dim]
        if not isinstance(parts, int) or parts < 1 or other != -1:
            raise InvalidValue(
                "shape", f'"{{path}}" = {list(entries)}: expected a positive block count at dim {dim} and -1 elsewhere'
            )
        return parts


class PartitionConfig(ConfigModel):
    """``partition_config``: custom layer rules (DeepSpeed's ``AutoTPConfig.from_dict``)."""

    layer_specs: tuple[LayerSpecConfig, ...] = ()
    """Rules tried in order; the first whose pattern matches a layer decides. DeepSpeed default: none."""

    use_default_specs: bool = True
    """With ``preset_model``: the preset's rules follow these (merged). DeepSpeed default: true."""

    strict_mode: bool = False
    """Every ``nn.Linear`` / ``Conv1D`` must be matched by some rule (skip included), else an error naming the
    unmatched layers. DeepSpeed default: false."""

    tp_size: PositiveInt = 1
    """DeepSpeed overwrites it with ``autotp_size``."""

    embedding_partition_dim: Int = 1
    """DeepSpeed's embedding split dim; embeddings stay replicated here unless a plan names them."""

    lm_head_patterns: Annotated[tuple[str, ...], BeforeValidator(_listlike_to_tuple)] = ("lm_head", "embed_out")
    """DeepSpeed's LM-head names; the LM head stays replicated here unless a rule names it."""

    @field_validator("layer_specs", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value


class TPInnerConfig(ConfigModel):
    """``tensor_parallel.tensor_parallel`` (alias ``tp``): DeepSpeed's inference ``TPConfig``, kept for its parser."""

    tp_size: PositiveInt = 1
    """DeepSpeed's training path sizes the tensor axis from ``autotp_size``, not this."""

    tp_grain_size: PositiveInt = 1
    """DeepSpeed: "not activated in training yet"."""

    mpu: Any = None
    """A Python object: pass ``mpu=`` to ``initialize`` instead."""

    tp_group: Any = None
    """A process group: a JSON config cannot carry one."""


class TensorParallelConfig(ConfigModel):
    """``tensor_parallel``: AutoTP training."""

    KEY_ALIASES: ClassVar[Mapping[str, str]] = {"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject"}

    autotp_size: NonNegativeInt = 0
    """Tensor-parallel degree AutoTP slices the model to; 0 or 1 = off. DeepSpeed default: 0."""

    preset_model: Annotated[str | None, BeforeValidator(_lower)] = None
    """A built-in plan: "gpt2", "llama", "mistral" or "qwen2" (shardspeed's presets). DeepSpeed default: none."""

    partition_config: PartitionConfig | None = None
    """Custom layer rules. DeepSpeed default: none."""

    sequence_parallel: bool = False
    """shardspeed's own key: Megatron sequence parallelism — activations between the sliced regions are split
    along the sequence, norms and dropout run on sequence shards. Default: false."""

    tp_overlap_comm: bool = False
    """Overlap the tensor-parallel all-reduce with computation. DeepSpeed default: false."""

    keep_module_on_host: bool = False
    """DeepSpeed's parser keeps loaded checkpoint tensors on the host. DeepSpeed default: false."""

    dtype: str | None = None
    """DeepSpeed's training engine passes its own dtype; the precision sections decide here too."""

    tensor_parallel: TPInnerConfig = Field(default_factory=TPInnerConfig)
    """DeepSpeed's inference TP settings (alias ``tp``)."""

    injection_policy_tuple: Any = None
    """DeepSpeed inference injection policies (Python classes)."""

    replace_with_kernel_inject: bool = False
    """DeepSpeed inference kernels (alias ``kernel_inject``)."""

    @field_validator("preset_model")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is None or value in AUTOTP_PRESETS:
            return value
        if value in DEEPSPEED_PRESETS_NOT_SHIPPED:
            raise ValueError(
                f'"{value}" is a DeepSpeed preset shardspeed does not ship yet (its layers need unequal fused blocks, '
                f"experts or MLA); shardspeed's presets: {', '.join(AUTOTP_PRESETS)}; or give "
                "partition_config.layer_specs"
            )
        raise ValueError(f'unknown preset "{value}"; shardspeed\'s presets: {", ".join(AUTOTP_PRESETS)}')

    @property
    def enabled(self) -> bool:
        return self.autotp_size > 1

    @property
    def layer_specs(self) -> tuple[LayerSpecConfig, ...]:
        return self.partition_config.layer_specs if self.partition_config is not None else ()
