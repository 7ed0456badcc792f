"""``shardspeed.profiling.flops_profiler`` mirrors ``deepspeed.profiling.flops_profiler``."""

from shardspeed.profiling.flops_profiler.profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
