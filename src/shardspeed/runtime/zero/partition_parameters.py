"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``.

``ZeroParamStatus`` is provided for imports; shardspeed keeps no ``ds_status`` attribute on parameters (no
attributes are hung on ``nn.Parameter``): ask ``shardspeed.zero.full_shape`` / ``GatheredParameters`` instead.
"""

from __future__ import annotations

from enum import Enum

from shardspeed.zero import GatheredParameters, Init, register_external_parameter


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # gathered: the full tensor is present
    NOT_AVAILABLE = 2  # partitioned: only this rank's shard
    INFLIGHT = 3  # a gather is running


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
