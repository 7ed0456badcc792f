"""Which dtypes a config trains with, as the memory model needs them ([Note: low-precision masters] in
config/precision.py): the compute dtype (parameters), the master dtype (what the optimizer steps, what gradients
accumulate in) and whether a separate master copy exists (only when the two differ)."""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.config import ShardSpeedConfig
from shardspeed.optim.build import state_bytes_per_element


def memory_precision(config: ShardSpeedConfig) -> str:
    """``zero/memory.py``'s precision name: "fp32", "bf16" (bf16 masters and states) or "mixed" (fp32 masters)."""
    if config.compute_dtype == torch.float32:
        return "fp32"
    return "bf16" if config.master_dtype == torch.bfloat16 else "mixed"


def optimizer_bytes_per_element(config: ShardSpeedConfig, optimizer: Any) -> int:
    """Optimizer-state bytes per stepped element plus the separate master copy's: states are kept in the stepped
    tensor's dtype (fp32 counts halved for bf16 masters), a master copy costs its dtype's size when the
    parameters are in another dtype."""
    states = state_bytes_per_element(optimizer) if optimizer is not None else 0
    master = config.master_dtype.itemsize
    states = states * master // 4
    return states + (master if config.compute_dtype != config.master_dtype else 0)
