"""AutoTP under the Hugging Face Trainer is refused with a clear error (its sampler splits batches by global rank)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from shardspeed.integrations.hf.trainer import refuse_autotp


def test_autotp_under_the_trainer_is_refused_naming_the_key() -> None:
    with pytest.raises(NotImplementedError, match=r"tensor_parallel\.autotp_size 2"):
        refuse_autotp({"tensor_parallel": {"autotp_size": 2}})


@pytest.mark.parametrize("config", [{}, {"tensor_parallel": {"autotp_size": 1}}, {"tensor_parallel": {}}])
def test_without_autotp_the_trainer_builds(config: dict) -> None:
    refuse_autotp(config)
