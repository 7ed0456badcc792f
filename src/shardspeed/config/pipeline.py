"""``pipeline``: DeepSpeed's pipeline section, typed, plus shardspeed's ``schedule`` and ``zero_hold``.

DeepSpeed reads ``pipe_partitioned`` / ``grad_partitioned`` in its pipeline engine; ``stages``, ``partition``,
``seed_layers`` and ``activation_checkpoint_interval`` it only stores: the ``PipelineModule`` is built by the
script *before* ``initialize`` reads the config, so the module's own arguments decide. We keep that rule and say
so ([Note: the module decides]): ``pipeline_config_conflicts`` — pure, called by the pipeline engine — turns a
stage count that disagrees with the module into an error and the other three into one warning each.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, PlainValidator, field_validator

from .base import ConfigModel, NonNegativeInt, show

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")
"""The names ``pipe/schedule.build_schedule`` knows (``pipeline.schedule``)."""

PARTITION_METHODS: tuple[str, ...] = ("parameters", "uniform", "type:REGEX")
"""``PipelineModule(partition_method=...)``'s values, as DeepSpeed spells them (``profile`` is refused there too)."""


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _stages(value: Any) -> Literal["auto"] | int:
    """``"auto"`` or a positive integer (``2.0`` from a generated config is 2); one message for anything else."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value  # type: ignore[return-value]
    raise ValueError(f'expected "auto" or a positive integer, got {show(value)}')


class PipelineConfig(ConfigModel):
    """``pipeline``: how a ``PipelineModule`` is trained. DeepSpeed default: every key at its default below."""

    AUTO_IS_VALUE: ClassVar[frozenset[str]] = frozenset({"stages"})

    stages: Annotated[Literal["auto"] | int, PlainValidator(_stages)] = "auto"
    """Pipeline stages. ``"auto"`` (DeepSpeed's default): the module's ``num_stages``. A number must equal it
    (an error naming both otherwise: ``mesh.resolve_mesh(pipeline_stages=)`` and ``pipeline_config_conflicts``).
    It never creates a pipe axis by itself: only a ``PipelineModule`` can be split into stages."""

    partition: str = "best"
    """How layers are split into stages: ``"parameters"``, ``"uniform"``, ``"type:REGEX"``. DeepSpeed's default
    ``"best"`` and any value equal to the module's ``partition_method`` are silent; another value is one warning:
    the module's method is used (it partitioned itself at construction)."""

    seed_layers: bool = False
    """Seed each layer's construction from ``base_seed + layer index``. The module's ``seed_layers`` decides; a
    different value here is one warning. DeepSpeed default: false."""

    activation_checkpoint_interval: NonNegativeInt = 0
    """Checkpoint activations every k layers (0: off). The module's value decides; a different value here is one
    warning. DeepSpeed default: 0."""

    pipe_partitioned: bool = True
    """With a tensor axis, each tensor rank sends 1/T of every float activation between stages and the receiver
    all-gathers it (``pipe/p2p.PipeChannel(partition=)``). No effect without a tensor axis. DeepSpeed default:
    true."""

    grad_partitioned: bool = True
    """The same for activation gradients sent backward. DeepSpeed default: true."""

    schedule: Annotated[Literal["1f1b", "gpipe", "interleaved"], BeforeValidator(_lower)] = "1f1b"
    """shardspeed's key: the schedule ``train_batch`` runs (``"interleaved"`` needs a module with
    ``virtual_stages >= 2``). DeepSpeed has 1F1B only. Default ``"1f1b"``."""

    zero_hold: Annotated[Literal["step", "micro_batch"], BeforeValidator(_lower)] = "step"
    """shardspeed's key, ZeRO-2/3 under a pipeline: ``"step"`` (default) accumulates fp32 gradients over the
    micro-batches of a ``train_batch`` and reduce-scatters once at its end (ZeRO-3 keeps each unit gathered for
    the step); ``"micro_batch"`` reduce-scatters (and ZeRO-3 gathers/releases) on every micro-batch: less memory,
    m× the traffic. Tied weights need ``"step"``."""

    @field_validator("partition")
    @classmethod
    def _known_partition(cls, value: str) -> str:
        low = value.lower()
        if low in ("best", "parameters", "uniform"):
            return low
        if low.startswith("type:"):
            try:
                re.compile(value[len("type:") :])
            except re.error as exc:
                raise ValueError(f'"{value}": the pattern after "type:" is not a regular expression ({exc})') from exc
            return value
        raise ValueError(f'"{value}" is not a partition method; expected one of {", ".join(PARTITION_METHODS)}')


# [Note: the module decides]
# DeepSpeed builds the PipelineModule in the script, before ``deepspeed.initialize`` has read the config: the
# layers are already partitioned, seeded and wrapped for activation checkpointing by then, and DeepSpeed never
# looks at ``pipeline.partition`` / ``seed_layers`` / ``activation_checkpoint_interval`` again. A config value
# the module contradicts is therefore a user's misunderstanding, not an instruction: we warn once per key
# (naming both values) and use the module's. A stage count is different: it decides the mesh, and a config
# promising 4 stages for a 2-stage module would silently train another topology, so that is an error.


@dataclass(frozen=True)
class ModuleSettings:
    """What a built ``PipelineModule`` decided, as ``pipeline_config_conflicts`` compares it."""

    num_stages: int
    partition_method: str
    seed_layers: bool
    activation_checkpoint_interval: int


def pipeline_config_conflicts(
    cfg: PipelineConfig, module: ModuleSettings | Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """Pure: (errors, warnings) from comparing the ``pipeline`` section with the module's own settings
    ([Note: the module decides]). ``module`` is a ``ModuleSettings`` or a mapping with its field names. Only keys
    the config *set* (``model_fields_set``) can conflict; DeepSpeed's defaults never do."""
    settings = module if isinstance(module, ModuleSettings) else ModuleSettings(**dict(module))
    errors: list[str] = []
    warnings: list[str] = []
    if cfg.stages != "auto" and cfg.stages != settings.num_stages:
        errors.append(
            f'pipeline.stages is {cfg.stages} but the PipelineModule has {settings.num_stages} stages: set "stages" '
            f'to {settings.num_stages} or "auto", or build the module with num_stages={cfg.stages}'
        )
    given = cfg.model_fields_set
    if "partition" in given and cfg.partition != "best":
        method = settings.partition_method
        same = cfg.partition == method if cfg.partition.startswith("type:") else cfg.partition == method.lower()
        if not same:
            warnings.append(_module_wins("partition", cfg.partition, "partition_method", method))
    for key in ("seed_layers", "activation_checkpoint_interval"):
        value, theirs = getattr(cfg, key), getattr(settings, key)
        if key in given and value != theirs:
            warnings.append(_module_wins(key, value, key, theirs))
    return errors, warnings


def _module_wins(key: str, value: Any, module_arg: str, module_value: Any) -> str:
    return (
        f"pipeline.{key} is {value!r} but the PipelineModule was built with {module_arg}={module_value!r}: the "
        "module's value is used (it is applied when the module is built, before the config is read, as in "
        "DeepSpeed)"
    )
