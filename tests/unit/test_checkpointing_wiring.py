"""initialize() configures shardspeed.checkpointing when the config names activation_checkpointing."""

from __future__ import annotations

import torch

import shardspeed
from shardspeed import checkpointing


def test_config_section_configures_activation_checkpointing() -> None:
    checkpointing.set_default_context(None)
    try:
        model = torch.nn.Linear(4, 4)
        base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        shardspeed.initialize(model=model, config=base)
        assert not checkpointing.is_configured()
        shardspeed.initialize(
            model=torch.nn.Linear(4, 4), config={**base, "activation_checkpointing": {"cpu_checkpointing": True}}
        )
        assert checkpointing.is_configured()
        assert checkpointing.default_context().config.cpu_checkpointing is True
    finally:
        checkpointing.set_default_context(None)
