"""DeepSpeed-compatible configuration: ``load_config(config, dp_world_size=...) -> ShardSpeedConfig``.

Module map: ``load`` (entry point and error rewriting), ``normalize`` (key names; the misspelling rule), ``keys``
(DeepSpeed keys we ignore or reject, and why), ``effects`` (what each typed field does), ``key_table`` (every
DeepSpeed 0.19 key: implemented / ignored / refused, assembled from those), ``batch`` (batch-size inference),
``root`` / ``precision`` / ``zero`` / ``zero_stage3`` / ``offload`` / ``sections`` (the typed sections), ``base``
(shared types), ``errors``.
"""

from __future__ import annotations

from .activation import ActivationCheckpointingConfig
from .batch import BatchSizes, resolve_batch_sizes
from .errors import ConfigError, did_you_mean, nearest
from .keys import IGNORED_KEYS, UNSUPPORTED_KEYS, KeyRule
from .load import ConfigSource, load_config
from .offload import IMPLEMENTED_OFFLOAD_DEVICES, OffloadOptimizerConfig, OffloadParamConfig
from .precision import BF16Config, FP16Config, parse_dtype
from .root import ShardSpeedConfig
from .sections import CommsLoggerConfig, OptimizerConfig, SchedulerConfig
from .zero import IMPLEMENTED_ZERO_STAGES, ZeroConfig

__all__ = [
    "IGNORED_KEYS",
    "IMPLEMENTED_OFFLOAD_DEVICES",
    "IMPLEMENTED_ZERO_STAGES",
    "UNSUPPORTED_KEYS",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "BatchSizes",
    "CommsLoggerConfig",
    "ConfigError",
    "ConfigSource",
    "FP16Config",
    "KeyRule",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ShardSpeedConfig",
    "ZeroConfig",
    "did_you_mean",
    "load_config",
    "nearest",
    "parse_dtype",
    "resolve_batch_sizes",
]
