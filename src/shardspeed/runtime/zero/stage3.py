"""``deepspeed.runtime.zero.stage3``: the stage-3 memory estimator (see ``estimate.py``)."""

from shardspeed.runtime.zero.estimate import estimate_zero3_model_states_mem_needs_all_live

__all__ = ["estimate_zero3_model_states_mem_needs_all_live"]
