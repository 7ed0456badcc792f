"""Real DeepSpeed config keys that shardspeed does not implement, sorted into two tables.

Which table a key is in depends on one question: *can the option change what training computes?*

``IGNORED_KEYS`` — monitors, profilers, loggers, timers, and performance-only switches. They can never
change the parameters a run produces, so a DeepSpeed config that sets them still means the same thing
here. The key is accepted and dropped, and (unless the value itself switches the feature off, e.g.
``"tensorboard": {"enabled": false}``) one line naming it is appended to ``cfg.warnings``.

``UNSUPPORTED_KEYS`` — options that change numerics or training behaviour (precision, parallelism, what
the data loader yields, what a step does, where checkpoints live). Silently dropping one would train a
different model than DeepSpeed would, so a config that *turns one on* is a ConfigError:
``"<key>" is a DeepSpeed option shardspeed does not support yet``. A config that mentions one only to
switch it off (``"amp": {"enabled": false}``, ``"sparse_gradients": false``) is accepted silently, since
ignoring it is then exactly what DeepSpeed does.

Keys are full dotted paths, so nested options live here too (``fp16.fused_mode``). ZeRO's own keys are
not here: every DeepSpeed ``zero_optimization`` key is a typed field of ``ZeroConfig``, and the ones
whose non-default values need unimplemented features are listed in ``ZeroConfig.NOT_YET_SUPPORTED``.

Moving a key out of ``UNSUPPORTED_KEYS`` is how a feature gets switched on once it is implemented (add a
typed field for it at the same time).

``SECTION_KEYS`` lists, for the tabled sections whose schema DeepSpeed fixes, the keys DeepSpeed 0.19 reads inside
them: ``normalize`` applies the misspelling rule there too (``"tensorboard": {"enabeld": true}`` would otherwise
read as switched off and pass in silence). A tabled section not listed there is free-form (``amp``'s keys go to
Apex, ``compression_training`` nests per technique): its contents are not checked.

Together with the typed sections (every field's effect is in ``effects.py``) these tables classify every DeepSpeed
0.19 key: ``key_table.py`` renders the whole table, and tests/unit/test_config_key_table.py checks it against the
inventory of DeepSpeed's keys in tests/compat/deepspeed_config_keys.json.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["IGNORED_KEYS", "SECTION_KEYS", "UNSUPPORTED_KEYS", "KeyRule"]


@dataclass(frozen=True)
class KeyRule:
    """How to treat one DeepSpeed key shardspeed does not implement."""

    feature: str
    """What the DeepSpeed option does, in a few words (used in messages)."""
    is_off: Callable[[Any], bool]
    """True when the value leaves the feature switched off, so ignoring it changes nothing."""
    how_to_turn_off: str
    """Appended to the not-supported error: what the user can write instead."""


def _enabled_false(value: Any) -> bool:
    """A section whose ``enabled`` flag is false or absent (all of these default to disabled)."""
    if value is None or value is False:
        return True
    return isinstance(value, Mapping) and value.get("enabled", False) is False


def _false(value: Any) -> bool:
    return value is None or value is False


def _empty(value: Any) -> bool:
    """Sections that have no on/off switch: merely present means in use."""
    return value is None or value == {}


def _all_falsy(value: Any) -> bool:
    """Every leaf is false/null/0/empty: e.g. a ``data_types`` block with every dtype null."""
    if isinstance(value, Mapping):
        return all(_all_falsy(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_falsy(v) for v in value)
    return not value


def _nothing_enabled(value: Any) -> bool:
    """No nested ``"enabled": true`` anywhere (compression_training has one switch per technique)."""
    if isinstance(value, Mapping):
        if value.get("enabled", False) is not False:
            return False
        return all(_nothing_enabled(v) for v in value.values())
    if isinstance(value, list):
        return all(_nothing_enabled(v) for v in value)
    return True


def _random_ltd_off(value: Any) -> bool:
    """DeepSpeed's engine acts on ``data_routing.random_ltd.enabled`` alone (``data_routing.enabled`` is never read)."""
    if not isinstance(value, Mapping):
        return value is None or value is False
    return _enabled_false(value.get("random_ltd"))


def _equals(*off_values: Any) -> Callable[[Any], bool]:
    """The value is one of DeepSpeed's defaults (strings compared case-insensitively)."""

    def check(value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, str):
            return value.lower() in {v.lower() for v in off_values if isinstance(v, str)}
        # bool is an int in Python: keep ``true`` from matching 1 and ``1`` from matching True.
        return any(isinstance(value, bool) == isinstance(v, bool) and value == v for v in off_values)

    return check


def _checkpoint_off(value: Any) -> bool:
    """``tag_validation`` only checks that all ranks agree on a checkpoint tag; the rest must be off."""
    if not isinstance(value, Mapping):
        return _empty(value)
    return all(_all_falsy(v) for k, v in value.items() if k != "tag_validation")


def _compile_off(value: Any) -> bool:
    """Every ``compile`` option applies only under ``deepcompile``."""
    if not isinstance(value, Mapping):
        return _empty(value)
    return value.get("deepcompile", False) is False


_ENABLED_OFF = 'remove it or set "enabled": false'
_REMOVE = "remove it"
_SET_FALSE = "remove it or set it to false"

IGNORED_KEYS: Mapping[str, KeyRule] = {
    # Monitors: they write metrics somewhere; the metrics do not feed back into training.
    "comet": KeyRule("the Comet monitor", _enabled_false, _ENABLED_OFF),
    "trackio": KeyRule("the Trackio monitor", _enabled_false, _ENABLED_OFF),
    # Profilers, timers and state dumps: they observe, and only add synchronisation.
    "timers": KeyRule("DeepSpeed's throughput timers", _nothing_enabled, _ENABLED_OFF),
    "memory_breakdown": KeyRule("per-step memory reports", _false, _SET_FALSE),
    "dump_state": KeyRule("dumping engine state after initialisation", _false, _SET_FALSE),
    "log_level": KeyRule("DeepSpeed's logger level", _empty, _REMOVE),
    "vocabulary_size": KeyRule("a tensor-core alignment hint (DeepSpeed only warns)", _empty, _REMOVE),
    # Performance-only switches: same result, different speed or memory.
    "disable_python_gc": KeyRule("disabling Python's cyclic garbage collector", _false, _SET_FALSE),
    "graph_harvesting": KeyRule("CUDA-graph capture of short kernel sequences", _false, _SET_FALSE),
    "disable_allgather": KeyRule("broadcasts instead of all-gather (legacy ZeRO-1)", _false, _SET_FALSE),
    # shardspeed's optimizer offload always steps on its own CPU Adam, so there is no choice to force.
    "zero_force_ds_cpu_optimizer": KeyRule("requiring DeepSpeed's CPU optimizer under offload", _empty, _REMOVE),
    # Nested: implementation choices inside sections we do implement.
    "fp16.fused_mode": KeyRule("choosing DeepSpeed's fused or unfused fp16 optimizer", _empty, _REMOVE),
    "optimizer.legacy_fusion": KeyRule("DeepSpeed's legacy fused-optimizer path", _false, _SET_FALSE),
    # When gradients are folded into the fp32 accumulator inside DeepSpeed's bf16 optimizer; shardspeed's
    # precision module decides its own accumulation order. Listed here (not rejected) because HF configs
    # commonly carry it; see the precision module for what shardspeed does.
    "bf16.immediate_grad_update": KeyRule("DeepSpeed's bf16-optimizer gradient hooks", _false, _SET_FALSE),
    # NVMe I/O engine choices: shardspeed's swapper is a thread pool of positional reads/writes (offload/swapper.py);
    # which engine moves the bytes changes speed only.
    "aio.io_backend": KeyRule("choosing the NVMe I/O engine (shardspeed uses its own)", _equals("async_io"), _REMOVE),
    "aio.use_gds": KeyRule("GPUDirect Storage", _false, _SET_FALSE),
}

UNSUPPORTED_KEYS: Mapping[str, KeyRule] = {
    # Precision: each changes the arithmetic of the forward/backward/step.
    "amp": KeyRule("NVIDIA Apex AMP mixed precision", _enabled_false, _ENABLED_OFF),
    "fp8": KeyRule("fp8 training", _enabled_false, _ENABLED_OFF),
    "fp16.fp16_master_weights_and_grads": KeyRule("fp16 master weights", _false, _SET_FALSE),
    "bf16.check_grad_overflow": KeyRule("skipping bf16 steps on inf/nan gradients", _false, _SET_FALSE),
    "bf16.check_overflow": KeyRule("skipping bf16 steps on inf/nan gradients", _false, _SET_FALSE),
    "compression_training": KeyRule("compression-aware training", _nothing_enabled, _ENABLED_OFF),
    "quantize_training": KeyRule("MoQ quantize-aware training", _enabled_false, _ENABLED_OFF),
    "weight_quantization": KeyRule("weight quantization", _empty, _REMOVE),
    "eigenvalue": KeyRule("eigenvalue-guided quantization", _enabled_false, _ENABLED_OFF),
    # Gradient reduction semantics.
    "gradient_allreduce_op": KeyRule('summing instead of averaging gradients ("sum")', _equals("mean"), _REMOVE),
    "sparse_gradients": KeyRule("CSR sparse embedding gradients", _false, _SET_FALSE),
    "managed_gradient_accumulation": KeyRule(
        "client-managed accumulation boundaries (false)", _equals(True), "remove it or set it to true"
    ),
    # Model / training-loop transformations.
    "sparse_attention": KeyRule("block-sparse attention kernels", _empty, _REMOVE),
    "progressive_layer_drop": KeyRule("progressive layer dropping", _enabled_false, _ENABLED_OFF),
    "data_efficiency.data_routing": KeyRule(
        "data routing (random-LTD token dropping)", _random_ltd_off, 'remove it or set "random_ltd.enabled": false'
    ),
    "data_efficiency.data_sampling.dynamic_batching": KeyRule(
        "dynamic batching (variable batch size and LR by token count)", _enabled_false, _ENABLED_OFF
    ),
    "dataloader_drop_last": KeyRule("dropping the last incomplete batch", _false, _SET_FALSE),
    "hybrid_engine": KeyRule("the RLHF hybrid (train + inference) engine", _enabled_false, _ENABLED_OFF),
    "compile": KeyRule("DeepCompile", _compile_off, 'remove it or set "deepcompile": false'),
    "elasticity": KeyRule("elastic batch sizes (overrides the batch keys)", _enabled_false, _ENABLED_OFF),
    # Parallelism other than data parallelism.
    "expert_parallel": KeyRule("AutoEP expert parallelism", _enabled_false, _ENABLED_OFF),
    "moe": KeyRule("mixture-of-experts layers", _empty, _REMOVE),
    "use_data_before_expert_parallelism": KeyRule("expert/data rank ordering", _false, _SET_FALSE),
    "sequence_parallel_size": KeyRule("Ulysses sequence parallelism", _equals(1), "remove it or set it to 1"),
    "seq_parallel_comm_data_type": KeyRule(
        "the sequence-parallel gradient dtype", _equals("fp32", "float32"), 'remove it or set it to "fp32"'
    ),
    "seq_parallel_communication_data_type": KeyRule(
        "the sequence-parallel gradient dtype", _equals("fp32", "float32"), 'remove it or set it to "fp32"'
    ),
    # Checkpoint storage engines and formats: where and how checkpoints are written and read back.
    "data_types.param_dtype": KeyRule("casting the model's parameters to another dtype", _empty, _REMOVE),
    "data_types.buffer_dtype": KeyRule("casting the model's buffers to another dtype", _empty, _REMOVE),
    "checkpoint": KeyRule(
        "universal checkpoints, node-local checkpoint storage, parallel checkpoint writers", _checkpoint_off, _REMOVE
    ),
    "nebula": KeyRule("the Nebula checkpoint service", _enabled_false, _ENABLED_OFF),
    "datastates": KeyRule("the DataStates checkpoint engine", _enabled_false, _ENABLED_OFF),
}


SECTION_KEYS: Mapping[str, tuple[str, ...]] = {
    # DeepSpeed 0.19's schema for tabled sections (monitor/config.py, profiling/config.py, utils/config.py,
    # runtime/constants.py, runtime/config.py, autotuning/constants.py, elasticity/constants.py, nebula/constants.py).
    "comet": (
        "enabled",
        "samples_log_interval",
        "project",
        "workspace",
        "api_key",
        "experiment_name",
        "experiment_key",
        "online",
        "mode",
    ),
    "trackio": ("enabled", "project"),
    "timers": ("throughput",),
    "timers.throughput": ("enabled", "synchronized"),
    "checkpoint": ("tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer"),
    "checkpoint.parallel_write": ("pipeline_stage",),
    "hybrid_engine": (
        "enabled",
        "max_out_tokens",
        "inference_tp_size",
        "release_inference_cache",
        "pin_parameters",
        "tp_gather_partition_size",
        "enable_cuda_graph",
    ),
    "progressive_layer_drop": ("enabled", "theta", "gamma"),
    "eigenvalue": (
        "enabled",
        "verbose",
        "max_iter",
        "tol",
        "stability",
        "gas_boundary_resolution",
        "layer_name",
        "layer_num",
    ),
    "elasticity": (
        "enabled",
        "max_train_batch_size",
        "micro_batch_sizes",
        "min_gpus",
        "max_gpus",
        "min_time",
        "version",
        "prefer_larger_batch",
        "ignore_non_elastic_batch_info",
        "model_parallel_size",
        "num_gpus_per_node",
    ),
    "nebula": (
        "enabled",
        "persistent_storage_path",
        "persistent_time_interval",
        "num_of_version_in_retention",
        "enable_nebula_load",
        "load_path",
    ),
}
"""Tabled section (dotted path) -> the keys DeepSpeed reads inside it."""
