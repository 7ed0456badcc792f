"""``flops_profiler``: a typed section with DeepSpeed 0.19.8's keys and defaults (profiling/constants.py)."""

from __future__ import annotations

import pytest

from shardspeed.config import ConfigError, load_config


def _load(section: object) -> object:
    return load_config({"train_micro_batch_size_per_gpu": 1, "flops_profiler": section}, dp_world_size=1)


def test_defaults_are_deepspeeds() -> None:
    cfg = _load({"enabled": True})
    fp = cfg.flops_profiler
    assert (fp.enabled, fp.recompute_fwd_factor, fp.profile_step, fp.module_depth, fp.top_modules) == (
        True,
        0.0,
        1,
        -1,
        1,
    )
    assert fp.detailed is True and fp.output_file is None
    assert cfg.warnings == []  # no longer "ignored"


def test_every_key_is_read() -> None:
    fp = _load(
        {
            "enabled": True,
            "recompute_fwd_factor": 1.0,
            "profile_step": 3,
            "module_depth": 2,
            "top_modules": 3,
            "detailed": False,
            "output_file": "out/flops_profile.txt",
        }
    ).flops_profiler
    assert (fp.recompute_fwd_factor, fp.profile_step, fp.module_depth, fp.top_modules) == (1.0, 3, 2, 3)
    assert fp.detailed is False and fp.output_file == "out/flops_profile.txt"


@pytest.mark.parametrize(
    ("section", "culprit"),
    [
        ({"enabled": True, "profile_step": -1}, "flops_profiler.profile_step"),
        ({"enabled": True, "module_depth": -2}, "flops_profiler.module_depth"),
        ({"enabled": True, "recompute_fwd_factor": -0.5}, "flops_profiler.recompute_fwd_factor"),
        ({"enabled": True, "profile_stpe": 1}, "profile_stpe"),
    ],
)
def test_bad_values_name_the_key(section: dict, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        _load(section)
