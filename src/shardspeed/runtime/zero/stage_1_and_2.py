"""``deepspeed.runtime.zero.stage_1_and_2``: the stage-2 memory estimators (see ``estimate.py``)."""

from shardspeed.runtime.zero.estimate import (
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = ["estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live"]
