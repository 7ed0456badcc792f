"""The ``zero_optimization`` keys that only ZeRO stage 3 (parameter partitioning) reads.

DeepSpeed accepts most of them with a ``stage3_`` prefix too; those spellings are aliases here (see
``STAGE3_ALIASES``): both are accepted, the value is stored under the unprefixed field, and giving both
spellings with different values is an error.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from .base import ConfigModel, NonNegativeInt

STAGE3_ALIASES: Mapping[str, str] = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    # DeepSpeed's older name for the same switch (from when only fp16 existed).
    "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
    "stage3_partition_stream_chunk_size": "partition_stream_chunk_size",
}


DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed's default ``leaf_module.classes``: Hugging Face's sparse MoE blocks, whose experts run data-dependently."""


class LeafModuleConfig(ConfigModel):
    """``zero_optimization.leaf_module``: modules stage 3 treats as leaves (DeepSpeed's schema). A module matching
    any entry is a leaf; see ``shardspeed.utils.set_z3_leaf_modules`` for the same in code."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names, bare (``"MoELayer"``) or fully qualified (``"my_pkg.model.MoELayer"``). DeepSpeed default:
    the Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks."""

    names: list[str] = Field(default_factory=list)
    """Module paths as in ``model.named_modules()`` (``"layers.3.mlp"``); a path the model lacks is an error.
    DeepSpeed default: []."""

    name_suffixes: list[str] = Field(default_factory=list)
    """Path endings: ``"mlp"`` matches ``layers.0.mlp``, ``layers.1.mlp``… DeepSpeed default: []."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: Any) -> Any:
        # DeepSpeed accepts a single string for each list
        return [value] if isinstance(value, str) else value


class Stage3Options(ConfigModel):
    """Fields of ``ZeroConfig`` used by stage 3 only. Counts are in elements, not bytes.

    The thresholds and limits may be 0 (DeepSpeed allows it: 0 disables prefetching, a 0 persistence
    threshold partitions every parameter), unlike the bucket sizes in ``ZeroConfig``, which must be > 0.
    """

    prefetch_bucket_size: NonNegativeInt = 50_000_000
    """Parameter elements to all-gather ahead of use (alias ``stage3_prefetch_bucket_size``).
    DeepSpeed default: 5e7. ``"auto"`` -> this default (the HF Trainer would use 0.9 * hidden_size**2)."""

    param_persistence_threshold: NonNegativeInt = 100_000
    """Parameters with fewer elements than this stay unpartitioned on every rank (alias
    ``stage3_param_persistence_threshold``). DeepSpeed default: 1e5. ``"auto"`` -> this default (the HF
    Trainer would use 10 * hidden_size)."""

    model_persistence_threshold: NonNegativeInt = sys.maxsize
    """Upper bound on the total elements kept unpartitioned by ``param_persistence_threshold`` (alias
    ``stage3_model_persistence_threshold``): small parameters join the persistent unit in registration order while
    the total fits; the rest are partitioned with their module. DeepSpeed default: sys.maxsize (no bound)."""

    max_live_parameters: NonNegativeInt = 1_000_000_000
    """Gathered parameter elements allowed per rank before releasing some (alias
    ``stage3_max_live_parameters``). DeepSpeed default: 1e9."""

    max_reuse_distance: NonNegativeInt = 1_000_000_000
    """Keep a gathered parameter if it is used again within this many elements of other parameters
    (alias ``stage3_max_reuse_distance``). DeepSpeed default: 1e9."""

    gather_16bit_weights_on_model_save: bool = False
    """Gather the partitioned 16-bit weights into a full ``state_dict`` when saving the model (aliases
    ``stage3_gather_16bit_weights_on_model_save``, ``stage3_gather_fp16_weights_on_model_save``).
    DeepSpeed default: false."""

    module_granularity_threshold: NonNegativeInt = 0
    """Modules whose granularity (parameter elements per layer of their subtree, DeepSpeed's rule) is at most this
    become leaves, parents first: their subtree is fetched as one unit (alias ``stage3_module_granularity_threshold``;
    ``shardspeed.zero.stage3.leaves``). DeepSpeed default: 0 (off)."""

    use_all_reduce_for_fetch_params: bool = False
    """Fetch parameters with all-reduce instead of all-gather (alias
    ``stage3_use_all_reduce_for_fetch_params``). DeepSpeed default: false."""

    allgather_sequential: bool = False
    """All-gather parameters one at a time instead of bucketed (alias ``stage3_allgather_sequential``).
    DeepSpeed default: false."""

    partition_stream_chunk_size: NonNegativeInt = 0
    """Partition very large parameters by streaming chunks of this many elements (alias
    ``stage3_partition_stream_chunk_size``). DeepSpeed default: 0 (off)."""

    memory_efficient_linear: bool = True
    """Use DeepSpeed's memory-efficient linear autograd function under stage 3. DeepSpeed default: true."""

    override_module_apply: bool = True
    """DeepSpeed gathers parameters around ``nn.Module.apply`` under stage 3. shardspeed patches no module: true makes
    an in-place write to a partitioned parameter outside a gathered block (``engine.module.apply(init_fn)`` after
    ``initialize``) raise at the next forward, pointing to ``shardspeed.zero.apply``; false skips that check.
    DeepSpeed default: true."""

    pipeline_loading_checkpoint: bool = False
    """Load checkpoints in pipeline mode under stage 3. One warning, no effect: shardspeed's checkpoints load at any
    pipeline degree and stage without it. DeepSpeed default: false."""

    log_trace_cache_warnings: bool = False
    """Log parameter-fetch trace-cache invalidations. DeepSpeed default: false."""

    enable_sanity_checks: bool = False
    """Run stage-3 internal consistency checks (debugging). DeepSpeed default: false."""

    save_muon_momentum_buffer_in_memory: bool = False
    """Keep Muon's momentum in memory instead of swapping it to NVMe. DeepSpeed default: false."""

    leaf_module: LeafModuleConfig = Field(default_factory=lambda: LeafModuleConfig())
    """ZeRO-3 leaf modules: each one's whole subtree is one unit, gathered around its forward, its children
    unhooked (mixture-of-experts layers; see ``shardspeed.zero.stage3.leaves``). DeepSpeed's section."""
