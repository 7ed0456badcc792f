"""``ShardSpeedConfig``: the whole typed config, one field per top-level DeepSpeed key we implement."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import Field, model_validator

from .activation import ActivationCheckpointingConfig
from .aio import AioConfig
from .autotuning import AutotuningConfig
from .base import ConfigModel, InvalidValue, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from .batch import BATCH_KEYS
from .communication import CommunicationConfig
from .fault_tolerance import FaultToleranceConfig
from .flops_profiler import FlopsProfilerConfig
from .monitor import CsvMonitorConfig, TensorBoardConfig, WandbConfig
from .pipeline import PipelineConfig
from .precision import BF16Config, DataTypesConfig, DtypeName, FP16Config, TorchAutocastConfig
from .sections import CommsLoggerConfig, OptimizerConfig, SchedulerConfig
from .tensor_parallel import TensorParallelConfig
from .zero import ZeroConfig


class ShardSpeedConfig(ConfigModel):
    """A parsed, validated DeepSpeed-compatible config. Build it with ``load_config``, which infers the
    batch sizes from the data-parallel world size and turns every problem into one ``ConfigError``."""

    KEY_ALIASES: ClassVar[Mapping[str, str]] = {"bfloat16": "bf16"}  # DeepSpeed's legacy section name
    AUTO_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset(BATCH_KEYS)
    INTERNAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"dp_world_size", "warnings"})

    train_batch_size: PositiveInt
    """Samples per optimizer step, summed over all data-parallel ranks:
    ``train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_world_size``. DeepSpeed: no default;
    inferred from the other two (``"auto"`` counts as absent)."""

    train_micro_batch_size_per_gpu: PositiveInt
    """Samples per rank per forward/backward. DeepSpeed: inferred when absent (``train_batch_size`` /
    world size when it is the only key given)."""

    gradient_accumulation_steps: PositiveInt
    """Micro-steps whose gradients are accumulated before each optimizer step. DeepSpeed: inferred when
    absent, 1 when only one of the other two keys is given."""

    dp_world_size: PositiveInt = 1
    """Data-parallel world size the batch keys were resolved for. Not a DeepSpeed key: the argument of
    ``load_config``."""

    optimizer: OptimizerConfig | None = None
    """Optimizer to build when ``initialize`` gets none. DeepSpeed default: none."""

    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule to build when ``initialize`` gets none. DeepSpeed default: none."""

    gradient_clipping: NonNegativeFloat = 0.0
    """Clip the global gradient L2 norm to this value before each optimizer step; 0 = no clipping.
    DeepSpeed's code default was 0.0 for years and its docs now say 1.0 (>= 0.19). We deliberately keep
    0.0: a clip the user did not ask for silently changes the optimizer's math. ``"auto"`` is an error
    (the HF Trainer would fill in its ``max_grad_norm``, 1.0 by default; we will not guess)."""

    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision with loss scaling. DeepSpeed default: disabled."""

    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision (legacy key ``bfloat16`` accepted). DeepSpeed default: disabled."""

    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """Run the forward under ``torch.autocast``. DeepSpeed default: disabled."""

    communication_data_type: DtypeName = None
    """dtype gradients are reduced in: "fp32"/"float32", "fp16"/"float16"/"half" or "bf16"/"bfloat16"
    (case-insensitive). DeepSpeed default: none, meaning the training dtype (``grad_comm_dtype``; see
    [Note: gradient dtypes] in config/precision.py)."""

    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """``grad_accum_dtype``: shardspeed accumulates in the master dtype (fp32, or bf16 with bf16 master
    weights). DeepSpeed default: the training dtype."""

    prescale_gradients: bool = False
    """Divide gradients by the world size before the all-reduce instead of after (overflow headroom for
    fp16). DeepSpeed default: false."""

    gradient_predivide_factor: PositiveFloat = 1.0
    """Divide gradients by this factor before the all-reduce and by ``world_size / factor`` after.
    DeepSpeed default: 1.0."""

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning settings. DeepSpeed default: stage 0."""

    zero_allow_untested_optimizer: bool = False
    """Allow ZeRO with an optimizer DeepSpeed has not tested with ZeRO. DeepSpeed default: false."""

    steps_per_print: PositiveInt = 10
    """Log progress (step, learning rate, skipped steps) every this many optimizer steps.
    DeepSpeed default: 10."""

    wall_clock_breakdown: bool = False
    """Time forward / backward / step separately (adds synchronisation). DeepSpeed default: false."""

    seed: NonNegativeInt | None = None
    """Seed torch's RNGs at ``initialize``. Not a DeepSpeed key (DeepSpeed leaves seeding to the script);
    default: none (do not seed)."""

    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Communication logging. DeepSpeed default: disabled."""

    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    """How ``shardspeed.checkpointing`` stores checkpointed inputs (partitioned, in CPU memory, ...).
    DeepSpeed default: every option off."""

    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous NVMe I/O settings, read by NVMe offload (``offload_optimizer.device: "nvme"``).
    DeepSpeed default: the defaults of each key."""

    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP: slice the model's linear layers over the tensor axis (config/tensor_parallel.py). DeepSpeed
    default: off (``autotp_size`` 0)."""

    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism (config/pipeline.py): read by the pipeline engine for a ``PipelineModule``; the module's
    own arguments decide partitioning, seeding and activation checkpointing. DeepSpeed default: every key at its
    default."""

    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    """Which torch.distributed call carries each engine collective, and the measured default bucket sizes
    (config/communication.py). Not a DeepSpeed key (shardspeed's own section)."""

    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    """What happens when something goes wrong: failure propagation, collective-order checks, non-finite steps,
    preemption, resume. Not a DeepSpeed key (shardspeed's own section)."""

    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """DeepSpeed's FLOPs profiler (config/flops_profiler.py; shardspeed/profiling/). DeepSpeed default: disabled."""
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    """DeepSpeed's autotuner (config/autotuning.py; shardspeed/autotuning/): the tuner's keys, and in a trial's config
    the engine's measurement window. DeepSpeed default: disabled."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor (config/monitor.py, shardspeed/monitor/). DeepSpeed default: disabled."""

    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    """CSV monitor, DeepSpeed's file layout (config/monitor.py, shardspeed/monitor/). DeepSpeed default: disabled."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor (config/monitor.py, shardspeed/monitor/). DeepSpeed default: disabled."""

    warnings: list[str] = Field(default_factory=list)
    """Messages for the engine to print once, on rank 0: DeepSpeed keys that were accepted but ignored,
    and ``"auto"`` values replaced by defaults. Not a DeepSpeed key."""

    @model_validator(mode="after")
    def _consistent(self) -> ShardSpeedConfig:
        product = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.dp_world_size
        if self.train_batch_size != product:
            raise InvalidValue(
                "train_batch_size",
                f"{self.train_batch_size} must equal train_micro_batch_size_per_gpu "
                f"({self.train_micro_batch_size_per_gpu}) × gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) × data-parallel world size ({self.dp_world_size}) "
                f"= {product}",
            )
        if self.fp16.enabled and self.bf16.enabled:
            raise InvalidValue(
                "fp16.enabled",
                '"{path}" and "bf16.enabled" are both true; mixed precision uses one 16-bit format, so '
                "enable at most one",
            )
        self._check_low_precision()
        return self

    def _check_low_precision(self) -> None:
        """DeepSpeed's combination rules for bf16 masters and torch_autocast (the sections' own validators check
        what lies inside one section)."""
        zero = self.zero_optimization
        accum = self.data_types.grad_accum_dtype
        if accum is not None and accum != self.master_dtype:
            raise InvalidValue(
                "data_types.grad_accum_dtype",
                f'"{{path}}" = "{str(accum).removeprefix("torch.")}": shardspeed accumulates gradients in '
                + (
                    'bf16 when "bf16.bf16_master_weights_and_grads" is true; remove the key or set it to "bf16"'
                    if self.bf16.bf16_master_weights_and_grads
                    else 'fp32 only (bf16 accumulation only with "bf16.bf16_master_weights_and_grads": true); remove '
                    'the key or set it to "fp32"'
                ),
            )
        if self.bf16.bf16_master_weights_and_grads:
            for key in ("offload_optimizer", "offload_param"):
                section = getattr(zero, key)
                if section is not None and section.device != "none":
                    raise InvalidValue(
                        "bf16.bf16_master_weights_and_grads",
                        f'"{{path}}" with zero_optimization.{key} (device "{section.device}") is not supported: '
                        "shardspeed's offload keeps fp32 values in its store. Remove the offload section or the "
                        "bf16 master weights",
                    )
        if self.torch_autocast.enabled and self.fp16.enabled:
            raise InvalidValue(
                "torch_autocast.enabled",
                '"{path}" with "fp16.enabled" is not supported: fp16 parameters under bfloat16 autocast would mix '
                'two 16-bit formats. Use "bf16" (or fp32 parameters) with torch_autocast',
            )

    @property
    def grad_comm_dtype(self) -> torch.dtype:
        """dtype of gradient reductions: ``communication_data_type``, else the training dtype (DeepSpeed's rule)."""
        return self.communication_data_type or self.compute_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype the optimizer steps and gradients accumulate in ([Note: low-precision masters]): bfloat16 with
        ``bf16.bf16_master_weights_and_grads``, else float32."""
        return torch.bfloat16 if self.bf16.bf16_master_weights_and_grads else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the forward/backward: float16 under fp16, bfloat16 under bf16, else float32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32
