"""``deepspeed.runtime.activation_checkpointing``: see ``shardspeed.checkpointing``."""
