"""What every key of the typed config does in shardspeed: it *acts*, it *warns* (accepted, no effect, and it
cannot change numerics or model-state memory: one warning when set to a non-default value), or it is *refused*
(a non-default value is a ConfigError naming the key and the missing feature).

Why a table: a DeepSpeed config is accepted key by key, and a key that parses but silently does nothing trains
something other than what its author planned (issue: ``override_module_apply``, ``leaf_module`` and ~18 others
were accepted and ignored). ``FIELD_EFFECTS`` names every field of every section (tests/unit/
test_config_keys_effect.py fails when a field is added without an entry), says why, and for warn/refuse entries
gives a non-default ``example`` the test uses. Keys that are not fields (monitors, DeepSpeed features not
implemented) are in keys.py's ``IGNORED_KEYS`` / ``UNSUPPORTED_KEYS``; refusals enforced by a section's own
validator (ZeRO++, MiCS, old offload spellings) are listed here as ``refused`` too, with ``by_validator=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .base import show

if TYPE_CHECKING:
    from .root import ShardSpeedConfig

Kind = Literal["acts", "warns", "refused"]


@dataclass(frozen=True)
class Effect:
    kind: Kind
    why: str
    """acts: what reads it; warns/refused: why it has no effect here / what feature is missing."""
    example: Any = None
    """warns/refused: a valid non-default value (tests set it and expect the warning / the error)."""
    by_validator: bool = False
    """refused by the section's own validator (zero.py), not by ``check_field_effects``."""
    falsy_is_off: bool = False
    """Any false-like value (false, null) leaves the feature off, not only the default."""


def _acts(why: str) -> Effect:
    return Effect("acts", why)


def _warns(why: str, example: Any) -> Effect:
    return Effect("warns", why, example)


def _refused(why: str, example: Any, by_validator: bool = False) -> Effect:
    return Effect("refused", why, example, by_validator)


_Z = "zero_optimization"
_PERF = "a performance knob: the values computed are the same"

FIELD_EFFECTS: Mapping[str, Effect] = {
    # --- batch, optimizer, schedule, precision --------------------------------------------------------------------
    "train_batch_size": _acts("batch inference (batch.py), data loader"),
    "train_micro_batch_size_per_gpu": _acts("batch inference, data loader"),
    "gradient_accumulation_steps": _acts("engine: loss scaling by 1/GAS and the step boundary"),
    "optimizer.type": _acts("optim/build.py"),
    "optimizer.params": _acts("optim/build.py"),
    "scheduler.type": _acts("schedulers/build.py"),
    "scheduler.params": _acts("schedulers/build.py"),
    "gradient_clipping": _acts("engine step: clip coefficient"),
    "fp16.enabled": _acts("compute dtype, loss scaler"),
    "fp16.auto_cast": _acts("engine forward casts inputs"),
    "fp16.loss_scale": _acts("LossScaler"),
    "fp16.initial_scale_power": _acts("LossScaler"),
    "fp16.loss_scale_window": _acts("LossScaler"),
    "fp16.hysteresis": _acts("LossScaler"),
    "fp16.consecutive_hysteresis": _acts("LossScaler"),
    "fp16.min_loss_scale": _acts("LossScaler"),
    "bf16.enabled": _acts("compute dtype"),
    "bf16.bf16_master_weights_and_grads": _acts("master dtype: stages' gradient buffers and stepped tensors"),
    "bf16.bf16_optimizer_states": _acts("validated with bf16_master_weights_and_grads (states follow the masters)"),
    "torch_autocast.enabled": _acts("engine forward under torch.autocast (precision/autocast.py)"),
    "torch_autocast.dtype": _acts("the autocast dtype (bfloat16 only)"),
    "torch_autocast.lower_precision_safe_modules": _refused(
        "per-module gradient communication dtypes; every gradient reduces in communication_data_type",
        ["torch.nn.Linear"],
    ),
    "communication_data_type": _acts("gradient reduction dtype (CommContext)"),
    "data_types.grad_accum_dtype": _acts(
        "validated: the master dtype gradients accumulate in (fp32; bf16 with bf16 masters)"
    ),
    "prescale_gradients": _acts("GradScaling"),
    "gradient_predivide_factor": _acts("GradScaling"),
    "zero_allow_untested_optimizer": _acts("engine: non-element-wise optimizers under ZeRO"),
    "steps_per_print": _acts("engine progress log and when the norm is computed"),
    "wall_clock_breakdown": _acts("timers.py"),
    "seed": _acts("initialize seeds torch"),
    "comms_logger.enabled": _acts("comm/log.py"),
    "tensorboard.enabled": _acts("monitor/: TensorBoardMonitor"),
    "tensorboard.output_path": _acts("monitor/: the event files' directory"),
    "tensorboard.job_name": _acts("monitor/: the event files' directory"),
    "csv_monitor.enabled": _acts("monitor/: CsvMonitor"),
    "csv_monitor.output_path": _acts("monitor/: the CSV files' directory"),
    "csv_monitor.job_name": _acts("monitor/: the CSV files' directory"),
    "wandb.enabled": _acts("monitor/: WandbMonitor"),
    "wandb.group": _acts("monitor/: wandb.init(group=)"),
    "wandb.team": _acts("monitor/: wandb.init(entity=)"),
    "wandb.project": _acts("monitor/: wandb.init(project=)"),
    "comms_logger.prof_ops": _acts("comm/log.py filters the logged operations"),
    "comms_logger.verbose": _warns("the comms log is a summary only (observability, no effect on training)", True),
    "comms_logger.prof_all": _warns("shardspeed filters by prof_ops whenever it is non-empty (observability)", False),
    "comms_logger.debug": _warns("caller names are not recorded (observability)", True),
    "curriculum_learning.enabled": _acts("training/curriculum.py: seqlen curriculum in forward / train_batch"),
    "curriculum_learning.curriculum_type": _acts("config/curriculum.py: only seqlen (others refused)"),
    "curriculum_learning.truncate": _acts("training/curriculum.py: the engine cuts the batch itself"),
    "curriculum_learning.min_difficulty": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.max_difficulty": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.schedule_type": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.schedule_config.total_curriculum_step": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.schedule_config.difficulty_step": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.schedule_config.root_degree": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.schedule_config.difficulty": _acts("data/curriculum/schedule.py"),
    "curriculum_learning.schedule_config.max_step": _acts("data/curriculum/schedule.py"),
    "data_efficiency.enabled": _acts("accepted; the sampler follows data_sampling.curriculum_learning"),
    "data_efficiency.seed": _acts("data/difficulty_sampler.py: the permutation of each round"),
    "data_efficiency.data_sampling.enabled": _acts("accepted as DeepSpeed does (its engine reads the inner flag)"),
    "data_efficiency.data_sampling.num_epochs": _acts("data/difficulty_sampler.py: epochs per loader iteration"),
    "data_efficiency.data_sampling.num_workers": _acts("data/engine_loader.py: DataLoader workers"),
    "data_efficiency.data_sampling.pin_memory": _refused(
        "pinned memory of DeepSpeed's dynamic-batching loader (the only reader of the key in DeepSpeed 0.19.8; "
        "dynamic batching is refused; shardspeed's loader pins host memory itself exactly on CUDA)",
        True,
    ),
    "data_efficiency.data_sampling.curriculum_learning.enabled": _acts("data/engine_loader.py: the difficulty sampler"),
    "data_efficiency.data_sampling.curriculum_learning.data_cluster_path": _acts(
        "accepted; clusters are recomputed in memory from the metric files, nothing is written there"
    ),
    "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics": _acts(
        "data/difficulty_sampler.py: per metric index files, difficulty type, clustering type and schedule"
    ),
    "flops_profiler.enabled": _acts("profiling/engine_profiler.py profiles one step"),
    "flops_profiler.recompute_fwd_factor": _acts("profiling/summary.py: the hardware FLOPS lines"),
    "flops_profiler.profile_step": _acts("profiling/engine_profiler.py: which step is profiled"),
    "flops_profiler.module_depth": _acts("profiling/summary.py: the aggregated tables' depth"),
    "flops_profiler.top_modules": _acts("profiling/summary.py: modules per depth"),
    "flops_profiler.detailed": _acts("profiling/summary.py: the per-module tree"),
    "flops_profiler.output_file": _acts("profiling/engine_profiler.py writes the summary there"),
    # --- autotuning (autotuning/) ---------------------------------------------------------------------------------
    "autotuning.enabled": _acts("autotuning/probe.py: measure the profile window, write the metric JSON, exit"),
    "autotuning.fast": _acts("autotuning/space.py: the smaller space"),
    "autotuning.results_dir": _acts("autotuning/results.py: where the results go"),
    "autotuning.exps_dir": _acts("autotuning/tune.py: one directory per trial"),
    "autotuning.overwrite": _acts("autotuning/tune.py: re-run trials that have results"),
    "autotuning.start_profile_step": _acts("autotuning/probe.py: first measured step"),
    "autotuning.end_profile_step": _acts("autotuning/probe.py: last measured step, then exit"),
    "autotuning.metric_path": _acts("autotuning/probe.py writes the metric JSON there"),
    "autotuning.metric": _acts("autotuning/tuners.py: what is ranked"),
    "autotuning.tuner_type": _acts("autotuning/tuners.py: the order of trials"),
    "autotuning.tuner_early_stopping": _acts("autotuning/tuners.py: stop without improvement"),
    "autotuning.tuner_num_trials": _acts("autotuning/tuners.py: at most this many trials"),
    "autotuning.arg_mappings": _acts("autotuning/tune.py: values passed as script arguments"),
    "autotuning.max_train_batch_size": _acts("autotuning/space.py: batch bounds"),
    "autotuning.min_train_batch_size": _acts("autotuning/space.py: batch bounds"),
    "autotuning.max_train_micro_batch_size_per_gpu": _acts("autotuning/space.py: micro-batch bounds"),
    "autotuning.min_train_micro_batch_size_per_gpu": _acts("autotuning/space.py: micro-batch bounds"),
    "autotuning.num_tuning_micro_batch_sizes": _acts("autotuning/space.py: micro-batch sizes per stage"),
    "autotuning.mp_size": _acts("autotuning/space.py: divides the data-parallel world"),
    "autotuning.model_info": _acts("autotuning/tune.py: num_params when given"),
    "autotuning.model_info_path": _acts("autotuning/tune.py: the model profile is written there"),
    "autotuning.device_memory_gb": _acts("autotuning/memory.py: the device budget"),
    "autotuning.host_memory_gb": _acts("autotuning/memory.py: the host budget"),
    "autotuning.progress_path": _acts("autotuning/probe.py appends per-step records there"),
    "autotuning.trial_timeout_s": _acts("autotuning/runner.py: a trial's time limit"),
    # --- activation checkpointing, aio --------------------------------------------------------------------------
    "activation_checkpointing.partition_activations": _acts("checkpointing/settings.py"),
    "activation_checkpointing.cpu_checkpointing": _acts("checkpointing/settings.py"),
    "activation_checkpointing.contiguous_memory_optimization": _acts("checkpointing/settings.py"),
    "activation_checkpointing.number_checkpoints": _acts("checkpointing/settings.py"),
    "activation_checkpointing.synchronize_checkpoint_boundary": _acts("checkpointing/settings.py"),
    "activation_checkpointing.profile": _acts("checkpointing/settings.py"),
    # --- communication (shardspeed's own section) ------------------------------------------------------------------
    "communication.collectives": _acts("comm/algorithms.py: the call behind each collective"),
    "communication.calibration_cache": _acts("comm/calibrate.py: where calibrations are cached"),
    "communication.simulated_link.bandwidth_gbps": _acts("comm/simulated_link.py: simulated bandwidth"),
    "communication.simulated_link.latency_us": _acts("comm/simulated_link.py: simulated latency per call"),
    # --- fault_tolerance (shardspeed's own section) --------------------------------------------------------------
    "fault_tolerance.propagate_failures": _acts("faults/: failure published and watched"),
    "fault_tolerance.watch_interval_s": _acts("faults/: the watcher's poll interval"),
    "fault_tolerance.collective_timeout_s": _acts("initialize: the process group's timeout"),
    "fault_tolerance.verify_collective_order": _acts("comm/: fingerprints agreed before each collective"),
    "fault_tolerance.skip_nonfinite_steps": _acts("training/nonfinite.py: non-finite steps skipped"),
    "fault_tolerance.max_consecutive_nonfinite": _acts("training/nonfinite.py: raise after k skipped steps"),
    "fault_tolerance.min_loss_scale_patience": _acts("training/nonfinite.py: fp16 overflow storm stops"),
    "fault_tolerance.checkpoint_dir": _acts("faults/: preemption save and auto-resume"),
    "fault_tolerance.save_on_preemption": _acts("faults/: save at the step boundary after a preemption signal"),
    "fault_tolerance.auto_resume": _acts("initialize: load the latest checkpoint of checkpoint_dir"),
    "fault_tolerance.preemption_signals": _acts("faults/: signal handlers installed at initialize"),
    "aio.block_size": _acts("offload swapper (AioSettings)"),
    "aio.queue_depth": _acts("offload swapper (AioSettings)"),
    "aio.thread_count": _acts("offload swapper (AioSettings)"),
    "aio.single_submit": _acts("offload swapper (AioSettings)"),
    "aio.overlap_events": _acts("offload swapper (AioSettings)"),
    # --- pipeline (config/pipeline.py; [Note: the module decides]) -------------------------------------------------
    "pipeline.stages": _acts("mesh.resolve_mesh's pipe size; checked against the PipelineModule's num_stages"),
    "pipeline.partition": _acts("checked against the PipelineModule's partition_method (one warning: module's used)"),
    "pipeline.seed_layers": _acts("checked against the PipelineModule's seed_layers (one warning: module's used)"),
    "pipeline.activation_checkpoint_interval": _acts(
        "checked against the PipelineModule's interval (one warning: the module's is used)"
    ),
    "pipeline.pipe_partitioned": _acts("pipe/p2p.py: activations sent 1/T per tensor rank, all-gathered"),
    "pipeline.grad_partitioned": _acts("pipe/p2p.py: activation gradients sent 1/T per tensor rank, all-gathered"),
    "pipeline.schedule": _acts("pipe/schedule.py build_schedule: the train_batch schedule"),
    "pipeline.zero_hold": _acts("pipe/engine.py: ZeRO-2/3 gradients reduced once per train_batch or per micro-batch"),
    # --- tensor_parallel (AutoTP) ---------------------------------------------------------------------------------
    "tensor_parallel.autotp_size": _acts(
        "tensor_parallel/autotp.py: the tensor-parallel degree the model is sliced to"
    ),
    "tensor_parallel.preset_model": _acts("tensor_parallel/hf_plans.py: the built-in plan"),
    "tensor_parallel.sequence_parallel": _acts("tensor_parallel/autotp.py: Megatron sequence parallelism"),
    "tensor_parallel.partition_config.layer_specs": _acts("tensor_parallel/plan.py: the custom plan's rules"),
    "tensor_parallel.partition_config.use_default_specs": _acts("tensor_parallel/plan.py: preset rules follow"),
    "tensor_parallel.partition_config.strict_mode": _acts("tensor_parallel/autotp.py: unmatched linear layers raise"),
    "tensor_parallel.partition_config.tp_size": _warns("DeepSpeed overwrites it with autotp_size too", 2),
    "tensor_parallel.partition_config.embedding_partition_dim": _warns(
        "embeddings stay replicated unless a plan rule names them (no embedding split dim to choose)", 0
    ),
    "tensor_parallel.partition_config.lm_head_patterns": _warns(
        "the LM head stays replicated unless a plan rule names it", ["output"]
    ),
    "tensor_parallel.tp_overlap_comm": _warns(_PERF, True),
    "tensor_parallel.keep_module_on_host": _warns("where DeepSpeed's parser stages loaded checkpoint tensors", True),
    "tensor_parallel.dtype": _warns("DeepSpeed's training engine ignores it too; fp16/bf16 decide the dtype", "bf16"),
    "tensor_parallel.tensor_parallel.tp_size": _warns("DeepSpeed's inference TP size; training uses autotp_size", 2),
    "tensor_parallel.tensor_parallel.tp_grain_size": _warns(
        "DeepSpeed's inference parser only (not activated in its training path either)", 64
    ),
    "tensor_parallel.tensor_parallel.mpu": _refused(
        "a Python object in a config; pass mpu= to initialize instead", "my_mpu"
    ),
    "tensor_parallel.tensor_parallel.tp_group": _refused(
        "a process group in a config; pass mpu= to initialize instead", "group"
    ),
    "tensor_parallel.injection_policy_tuple": _refused("DeepSpeed inference injection policies", ["GPT2Block"]),
    "tensor_parallel.replace_with_kernel_inject": _refused("DeepSpeed inference kernels", True),
    # --- zero_optimization ----------------------------------------------------------------------------------------
    f"{_Z}.stage": _acts("which model states (zero/__init__.py)"),
    f"{_Z}.overlap_comm": _acts("reducers launch asynchronously or one bucket at a time"),
    f"{_Z}.overlap_param_gather": _acts("stages 1/2: parameter all-gather waited by the next forward"),
    f"{_Z}.reduce_bucket_size": _acts(
        "bucket size (stages 0-2); stage 3 reduce-scatters each unit in pieces of at most this many elements"
    ),
    f"{_Z}.allgather_bucket_size": _acts("bucket size, stages 1-2"),
    f"{_Z}.offload_param.device": _acts("stage3/param_offload.py"),
    f"{_Z}.offload_param.nvme_path": _acts("stage3/param_offload.py"),
    f"{_Z}.offload_param.pin_memory": _acts("stage3/param_offload.py"),
    f"{_Z}.offload_param.buffer_count": _acts("stage3/param_offload.py"),
    f"{_Z}.offload_param.buffer_size": _acts("stage3/param_offload.py"),
    f"{_Z}.offload_param.max_in_cpu": _acts("stage3/param_offload.py"),
    f"{_Z}.offload_optimizer.device": _acts("offload/wrap.py"),
    f"{_Z}.offload_optimizer.nvme_path": _acts("offload/wrap.py"),
    f"{_Z}.offload_optimizer.pin_memory": _acts("offload/wrap.py"),
    f"{_Z}.offload_optimizer.buffer_count": _acts("offload/stream.py"),
    f"{_Z}.offload_optimizer.fast_init": _acts("offload/stream.py"),
    f"{_Z}.offload_optimizer.ratio": _acts("offload/optimizer.py"),
    f"{_Z}.offload_optimizer.pipeline_read": _acts("offload/stream.py"),
    f"{_Z}.offload_optimizer.pipeline_write": _acts("offload/stream.py"),
    f"{_Z}.offload_optimizer.offload_gradients": _acts("stage3/grad_offload.py (ZeRO-3, nvme)"),
    f"{_Z}.offload_optimizer.super_offload": _warns(
        "no SuperOffload (superchip) path: the standard offload runs, same numerics", True
    ),
    f"{_Z}.offload_optimizer.convert_grad_on_cpu": _warns(
        "gradients are converted where the reduction leaves them; the fp32 values are the same", False
    ),
    f"{_Z}.offload_optimizer.cpuadam_cores_perc": _warns("only read by SuperOffload, which shardspeed lacks", 0.5),
    f"{_Z}.sub_group_size": _acts("offload_optimizer chunk size (offload/stream.py)"),
    f"{_Z}.ignore_unused_parameters": _acts("engine step raises on unused parameters when false"),
    f"{_Z}.prefetch_bucket_size": _acts("stage3/prefetch.py prefetch budget"),
    f"{_Z}.param_persistence_threshold": _acts("stage3/plan.py persistent unit"),
    f"{_Z}.model_persistence_threshold": _acts("stage3/plan.py caps the persistent unit's elements"),
    f"{_Z}.max_live_parameters": _acts("stage3/prefetch.py prefetch bound"),
    f"{_Z}.max_reuse_distance": _acts("stage3/prefetch.py keeps units used again soon"),
    f"{_Z}.gather_16bit_weights_on_model_save": _acts("stage3/save.py"),
    f"{_Z}.module_granularity_threshold": _acts("stage3/leaves.py makes small-granularity modules leaves"),
    f"{_Z}.leaf_module.classes": _acts("stage3/leaves.py"),
    f"{_Z}.leaf_module.names": _acts("stage3/leaves.py"),
    f"{_Z}.leaf_module.name_suffixes": _acts("stage3/leaves.py"),
    f"{_Z}.override_module_apply": _acts(
        "stage3/apply_guard.py: writes to partitioned parameters outside a gathered block (module.apply after "
        "initialize) raise at the next forward; use shardspeed.zero.apply. false skips the check"
    ),
    f"{_Z}.contiguous_gradients": _warns("gradients always live in flat buffers here (no other layout)", False),
    f"{_Z}.reduce_scatter": _warns(f"stages 1-3 always reduce-scatter; {_PERF}", False),
    f"{_Z}.use_multi_rank_bucket_allreduce": _warns(_PERF, False),
    f"{_Z}.allgather_partitions": _warns(f"shardspeed always all-gathers; {_PERF}", False),
    f"{_Z}.use_all_reduce_for_fetch_params": _warns(f"parameters are fetched by all-gather; {_PERF}", True),
    f"{_Z}.allgather_sequential": _warns(f"units are all-gathered whole; {_PERF}", True),
    f"{_Z}.partition_stream_chunk_size": _warns("stage 3 already partitions one unit at a time", 1_000_000),
    f"{_Z}.memory_efficient_linear": _warns(
        "shardspeed's gathered parameters are released whatever the linear layer saves (stage3/saved_views.py)",
        False,
    ),
    f"{_Z}.round_robin_gradients": _warns(_PERF, True),
    f"{_Z}.legacy_stage1": _warns("one stage-1 implementation; the math is the same", True),
    f"{_Z}.compute_grad_norm": _warns("the norm is computed only when clipping, fp16 or the log needs it", False),
    f"{_Z}.parameter_alignment": _warns("flat-buffer padding only; the values are the same", True),
    f"{_Z}.elastic_checkpoint": _warns("every shardspeed checkpoint loads at any world size", True),
    f"{_Z}.log_trace_cache_warnings": _warns("no trace cache to log (observability)", True),
    f"{_Z}.enable_sanity_checks": _warns("the unit-id check of every gather and reduce-scatter always runs", True),
    f"{_Z}.save_muon_momentum_buffer_in_memory": _warns("shardspeed has no Muon optimizer", True),
    f"{_Z}.cpu_offload_use_pin_memory": Effect(
        "warns", "old spelling; set offload_*.pin_memory instead (speed only)", True, falsy_is_off=True
    ),
    f"{_Z}.load_from_fp32_weights": _refused(
        "rebuilding fp32 masters from the 16-bit weights on load: shardspeed always restores the saved fp32 values",
        False,
    ),
    f"{_Z}.pipeline_loading_checkpoint": _warns(
        "checkpoints load at any pipeline degree and ZeRO stage without it (checkpoint/pipe_stages.py)", True
    ),
    f"{_Z}.cpu_offload": _acts('old spelling: true becomes offload_optimizer {"device": "cpu"} (zero.py)'),
    f"{_Z}.cpu_offload_param": _acts('old spelling: true becomes offload_param {"device": "cpu"} (zero.py)'),
    f"{_Z}.zero_hpz_partition_size": _refused("ZeRO++ hpZ", 8, by_validator=True),
    f"{_Z}.zero_quantized_weights": _refused("ZeRO++ quantized weights", True, by_validator=True),
    f"{_Z}.zero_quantized_nontrainable_weights": _refused("ZeRO++ quantized frozen weights", True, by_validator=True),
    f"{_Z}.zero_quantized_gradients": _refused("ZeRO++ quantized gradients", True, by_validator=True),
    f"{_Z}.zeropp_loco_param": _refused("LoCo-ZeRO++", {"err_beta": 0.8}, by_validator=True),
    f"{_Z}.mics_shard_size": _refused("MiCS", 4, by_validator=True),
    f"{_Z}.mics_hierarchical_params_gather": _refused("MiCS", True, by_validator=True),
    f"{_Z}.zenflow": _refused("ZenFlow", {"topk_ratio": 0.1}, by_validator=True),
}


def _value_at(config: Any, path: str) -> tuple[bool, Any]:
    """(is the field at its default, its value). A missing optional section counts as default."""
    *sections, name = path.split(".")
    node = config
    for section in sections:
        node = getattr(node, section)
        if node is None:
            return True, None
    value = getattr(node, name)
    field = type(node).model_fields[name]
    default = field.get_default(call_default_factory=True)
    return value == default and isinstance(value, bool) == isinstance(default, bool), value


def check_field_effects(config: ShardSpeedConfig) -> tuple[list[str], list[str]]:
    """(warnings, problems) for the keys of ``config`` set to a non-default value that have no effect here."""
    warnings, problems = [], []
    for path, effect in FIELD_EFFECTS.items():
        if effect.kind == "acts" or effect.by_validator:
            continue
        is_default, value = _value_at(config, path)
        if is_default or (effect.falsy_is_off and not value):
            continue
        if effect.kind == "warns":
            warnings.append(f'"{path}" = {show(value)} has no effect in shardspeed: {effect.why}')
        else:
            problems.append(
                f'"{path}" = {show(value)} is a DeepSpeed option shardspeed does not support yet ({effect.why}); '
                "remove it to use the default"
            )
    return warnings, problems
