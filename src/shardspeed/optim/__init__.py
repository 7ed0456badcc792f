"""Optimizer construction from DeepSpeed-style config, plus the LAMB and Lion optimizers.

Note: DeepSpeed's config type ``"Adam"`` means AdamW (decoupled weight decay) unless ``adam_w_mode`` is
false — see ``shardspeed.optim.specs``.
"""

from __future__ import annotations

from shardspeed.optim.build import build_optimizer, is_elementwise
from shardspeed.optim.lamb import Lamb
from shardspeed.optim.lion import Lion
from shardspeed.optim.names import canonical_optimizer_name, known_optimizer_names
from shardspeed.optim.specs import validate_optimizer_params

__all__ = [
    "Lamb",
    "Lion",
    "build_optimizer",
    "canonical_optimizer_name",
    "is_elementwise",
    "known_optimizer_names",
    "validate_optimizer_params",
]
