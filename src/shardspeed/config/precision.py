"""Mixed-precision sections (``fp16``, ``bf16``, ``torch_autocast``, ``data_types``) and the dtype names configs
may use.

[Note: low-precision masters] ``bf16.bf16_master_weights_and_grads`` (+ ``bf16_optimizer_states``, DeepSpeed PR
7700): the *master dtype* becomes bf16. A master copy exists only where the master dtype differs from the
parameters' dtype, so with bf16 parameters there is none: the optimizer steps the parameter storage itself
(stage 0: the parameters; stages 1/2: slices of the flat parameter buffer; stage 3: the shards), exactly as in
fp32 training, gradients accumulate and reduce in bf16 (the gradient buffer / shards take the master dtype) and
torch's optimizers keep their states in the stepped tensor's dtype (bf16). Per rank, Adam: params 2Ψ + grads 2Ψ
+ states 4Ψ, divided as the stage divides them (``zero/memory.py``) — DeepSpeed's 10Ψ counts a separate bf16
master copy shardspeed does not keep.

[Note: gradient dtypes] Two dtypes decide what a gradient goes through between backward and the optimizer:
- the *communication* dtype (``communication_data_type``): what reductions send. Default, as in DeepSpeed
  (``engine.communication_data_type``, 0.19 included): the training dtype, i.e. fp16 under fp16 and bf16 under
  bf16 — half the traffic of fp32. ``"fp32"`` keeps fp32 reductions. Every stage sums in that dtype; the result
  is added into fp32 right after. Measured (tests/dist/test_zero3_comm_costs.py, a 2-layer MLP, 20 AdamW steps,
  world 2): bf16 reductions vs fp32 reductions change the final loss by < 1% — within bf16 training's own
  noise, so we follow DeepSpeed.
- the *accumulation* dtype (``data_types.grad_accum_dtype``): where gradients sum across micro-steps and what
  the optimizer reads: the master dtype ([Note: low-precision masters]: bf16 only when the config asks for bf16
  master weights). DeepSpeed defaults it to the training dtype; shardspeed otherwise accumulates in fp32 (the
  flat gradient buffer / the fp32 gradient shards) and accepts only ``"fp32"`` (or null) here. A deliberate
  difference: summing many micro-steps in bf16 loses the low bits of every small gradient, and our gradient
  memory is already one fp32 copy per element (stage 0/1) or per shard (stages 2/3).
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, Field, field_validator, model_validator

from .base import ConfigModel, InvalidValue, NonNegativeFloat, PositiveFloat, PositiveInt, show

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: Any) -> torch.dtype | None:
    """A dtype name as DeepSpeed configs spell it (case-insensitive), a ``torch.dtype``, or None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES.values():
            return value
        raise ValueError(f"expected torch.float32, torch.float16 or torch.bfloat16, got {value}")
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else None
    if name is not None and name in _DTYPE_NAMES:  # "bf16", "bfloat16", "torch.bfloat16" (DeepSpeed's forms)
        return _DTYPE_NAMES[name]
    names = ", ".join(f'"{name}"' for name in _DTYPE_NAMES)
    raise ValueError(f"expected one of {names} (any case), got {show(value)}")


DtypeName = Annotated[torch.dtype | None, BeforeValidator(parse_dtype)]


class FP16Config(ConfigModel):
    """``fp16``: fp16 mixed precision with loss scaling (fp32 master weights)."""

    enabled: bool = False
    """Train in fp16 mixed precision. DeepSpeed default: false. Cannot be combined with ``bf16``."""

    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16. DeepSpeed default: false."""

    loss_scale: NonNegativeFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling. DeepSpeed default: 0 (dynamic)."""

    initial_scale_power: Annotated[int, Field(ge=0, le=127)] = 16
    """Dynamic scaling starts at ``2**initial_scale_power``. DeepSpeed default: 16. Capped at 127 so the
    starting scale is a finite fp32 number."""

    loss_scale_window: PositiveInt = 1000
    """Dynamic scaling doubles the scale after this many consecutive overflow-free steps.
    DeepSpeed default: 1000."""

    hysteresis: PositiveInt = 2
    """Dynamic scaling lowers the scale only after this many overflowing steps (delayed shift).
    DeepSpeed default: 2."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every overflow-free step, so only *consecutive* overflows lower the
    scale. DeepSpeed default: false."""

    min_loss_scale: PositiveFloat = 1.0
    """The dynamic scale never drops below this. DeepSpeed default: 1."""


class BF16Config(ConfigModel):
    """``bf16`` (legacy spelling ``bfloat16``): bf16 mixed precision; bf16's fp32-sized exponent range
    makes loss scaling unnecessary."""

    enabled: bool = False
    """Train in bf16 mixed precision. DeepSpeed default: false. Cannot be combined with ``fp16``."""

    bf16_master_weights_and_grads: bool = False
    """Keep the optimizer's master weights and the gradients in bf16 instead of fp32 (see [Note: low-precision
    masters]): the optimizer steps the bf16 parameter storage itself, gradients accumulate and are reduced in
    bf16. DeepSpeed default: false. Requires ``bf16.enabled`` and ``bf16_optimizer_states`` (DeepSpeed allows
    fp32 states beside bf16 masters only with ZeRO-Offload's CPU Adam, which shardspeed does not pair with bf16
    masters); no ``offload_optimizer`` / ``offload_param``. DeepSpeed accepts it at ZeRO stages 1-3 only;
    shardspeed also at stage 0 (plain bf16 data parallelism)."""

    bf16_optimizer_states: bool = False
    """Keep optimizer states (Adam's moments) in bf16. DeepSpeed default: false. Requires
    ``bf16_master_weights_and_grads`` (DeepSpeed's rule): torch optimizers keep their states in the stepped
    tensor's dtype, so bf16 masters give bf16 states."""

    @model_validator(mode="after")
    def _masters_and_states(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise InvalidValue(
                "bf16_optimizer_states",
                '"{path}" requires "bf16.bf16_master_weights_and_grads": true (DeepSpeed\'s rule: bf16 optimizer '
                "states live beside bf16 master weights)",
            )
        if self.bf16_master_weights_and_grads and not self.enabled:
            raise InvalidValue(
                "bf16_master_weights_and_grads",
                '"{path}" requires "bf16.enabled": true (bf16 master weights are bf16 parameters stepped in place)',
            )
        if self.bf16_master_weights_and_grads and not self.bf16_optimizer_states:
            raise InvalidValue(
                "bf16_master_weights_and_grads",
                '"{path}" without "bf16.bf16_optimizer_states": true is not supported: DeepSpeed allows bf16 master '
                "weights beside fp32 optimizer states only with ZeRO-Offload and DeepSpeedCPUAdam, which shardspeed "
                'does not pair with bf16 masters. Set "bf16_optimizer_states": true as well, or remove both',
            )
        return self


class TorchAutocastConfig(ConfigModel):
    """``torch_autocast``: run the module's forward under ``torch.autocast(device, dtype)`` (inside
    ``engine.forward``, as DeepSpeed's ``autocast_if_enabled``). Parameters keep the dtype the rest of the config
    gives them (DeepSpeed's rule: fp32, or bf16 with ``bf16.enabled``); autocast picks each op's dtype."""

    enabled: bool = False
    """Wrap the forward in ``torch.autocast``. DeepSpeed default: false."""

    dtype: DtypeName = torch.bfloat16
    """The autocast dtype (``"bfloat16"``, ``"torch.bfloat16"``, …). DeepSpeed default: bfloat16. shardspeed
    accepts bfloat16 only: fp16 autocast needs the gradient scaler DeepSpeed adds at stage 0, which shardspeed
    lacks."""

    lower_precision_safe_modules: list[str] | None = None
    """Module classes whose parameters' gradients DeepSpeed reduces in the autocast dtype. DeepSpeed default:
    null = Linear and Conv1d/2d/3d. shardspeed reduces every gradient in ``communication_data_type`` (default:
    the parameters' dtype) and refuses a non-null value here."""

    @field_validator("dtype")
    @classmethod
    def _bf16_only(cls, value: torch.dtype | None) -> torch.dtype | None:
        if value is None:  # null: the default, as DeepSpeed reads it
            return torch.bfloat16
        if value != torch.bfloat16:
            raise ValueError(
                f"shardspeed's torch_autocast supports bfloat16 only; got {str(value).removeprefix('torch.')} (fp16 "
                "autocast needs a gradient scaler shardspeed does not build)"
            )
        return value


class DataTypesConfig(ConfigModel):
    """``data_types``: DeepSpeed's gradient-accumulation dtype override (see [Note: gradient dtypes])."""

    grad_accum_dtype: DtypeName = None
    """dtype gradients accumulate in across micro-steps. DeepSpeed default: null = the training dtype.
    shardspeed accumulates in the master dtype: fp32 (accepts ``"fp32"`` or null; a deliberate difference), or
    bf16 with ``bf16.bf16_master_weights_and_grads`` (accepts ``"bf16"`` or null; checked in root.py)."""

    @field_validator("grad_accum_dtype")
    @classmethod
    def _fp32_only(cls, value: torch.dtype | None) -> torch.dtype | None:
        if value not in (None, torch.float32, torch.bfloat16):  # bf16: only beside bf16 masters (root.py)
            raise ValueError(
                f"shardspeed accumulates gradients in fp32 only; got {str(value).removeprefix('torch.')}. Remove "
                'the key or set it to "fp32" (bf16/fp16 accumulation would drop the low bits of small gradients)'
            )
        return value
