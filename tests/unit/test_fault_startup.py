"""The process-group timeout failure propagation relies on: read from the config before the group exists."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import shardspeed
import shardspeed.api
import shardspeed.distributed
from shardspeed.faults.errors import FailureRecord, PeerFailedError
from shardspeed.faults.startup import configured_timeout, default_timeout, early_fault_config


def test_default_timeouts() -> None:
    assert default_timeout("gloo") == timedelta(seconds=600)
    assert default_timeout("nccl") == timedelta(seconds=1800)


def test_early_fault_config_reads_the_raw_section(tmp_path: Path) -> None:
    section = {"fault_tolerance": {"collective_timeout_s": 42, "watch_interval_s": 0.25}}
    assert configured_timeout(early_fault_config(section)) == timedelta(seconds=42)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, **section}))
    assert early_fault_config(str(path)).watch_interval_s == 0.25
    assert configured_timeout(early_fault_config({})) is None
    # an invalid section is load_config's to report (with its message); here only the defaults
    assert early_fault_config({"fault_tolerance": {"collective_timeout_s": -1}}).collective_timeout_s is None


class _Stop(Exception):
    pass


def test_init_distributed_passes_the_backend_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_init(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", fake_init)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(_Stop):
        shardspeed.init_distributed(dist_backend="gloo")
    assert seen["timeout"] == timedelta(seconds=600)
    with pytest.raises(_Stop):
        shardspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=7))
    assert seen["timeout"] == timedelta(seconds=7)


def test_initialize_passes_collective_timeout_s(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_init_distributed(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(shardspeed.api, "init_distributed", fake_init_distributed)
    config = {"train_batch_size": 2, "fault_tolerance": {"collective_timeout_s": 90}}
    with pytest.raises(_Stop):
        shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert seen["timeout"] == timedelta(seconds=90)


def test_peer_failed_message_names_rank_error_and_what_this_rank_did() -> None:
    record = FailureRecord(1, "engine.step() at step 3", "RuntimeError: incompatible optimizer state", 0.0)
    error = PeerFailedError(record, "waiting in all_reduce 'grads' over the data axis (ranks [0, 1])")
    assert str(error) == (
        "rank 1 failed in engine.step() at step 3: RuntimeError: incompatible optimizer state "
        "(this rank was waiting in all_reduce 'grads' over the data axis (ranks [0, 1]))"
    )
    assert FailureRecord.from_json(record.to_json()) == record
