"""Collectives over explicit mesh axes, and the comms log; plus DeepSpeed's ``deepspeed.comm`` functions.

``Collectives`` / ``CommsLog`` are the engine's layer. The DeepSpeed-named functions (``get_rank``,
``all_reduce``, ``barrier``, ...) live in ``comm/api.py`` for training scripts written as
``import deepspeed.comm as dist``; importing them here costs nothing extra (torch is already imported).
"""

from shardspeed.comm.api import *  # noqa: F403  (DeepSpeed's deepspeed.comm names; see comm/api.py __all__)
from shardspeed.comm.api import __all__ as _deepspeed_names
from shardspeed.comm.collectives import Collectives
from shardspeed.comm.log import CommsLog
from shardspeed.comm.work import CompositeWork, P2PWork, Work

__all__ = ["Collectives", "CommsLog", "CompositeWork", "P2PWork", "Work", *_deepspeed_names]
