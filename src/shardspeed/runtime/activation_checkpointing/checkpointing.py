"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same module as ``shardspeed.checkpointing``."""

from shardspeed.checkpointing import *  # noqa: F403
from shardspeed.checkpointing import __all__  # noqa: F401
