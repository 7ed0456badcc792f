"""Integrations with other training frameworks.

``shardspeed.integrations.hf``: the Hugging Face Trainer path (``ShardSpeedTrainer``) and building HF models under
``zero.Init`` (``from_config``). Nothing here is imported by ``import shardspeed``; transformers is an optional
dependency (the ``hf`` extra).
"""
