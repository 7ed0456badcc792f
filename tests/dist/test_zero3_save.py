"""engine.save_16bit_model: one safetensors file with the full state dict, streamed from rank 0.

The file is read back with safetensors' own loader (an independent parser of the format) and compared bitwise
with ``engine.module_state_dict()``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import TinyNet, global_batches, rank_slice
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed._tools.mem_tracker import MemTracker

import shardspeed
from shardspeed.zero.stage3.save import save_16bit_model

MB = 2


class WithBuffer(TinyNet):
    """The parity model with a tied weight (mid/mid2), a frozen bias and an integer buffer."""

    def __init__(self) -> None:
        super().__init__(tied=True, frozen=True)
        self.register_buffer("step_ids", torch.arange(3))


def _config(stage: int, gather: bool = True, precision: str = "fp32") -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": gather,
        },
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1000,
    }


def _train_and_save(rank: int, world: int, out_dir: str, stage: int, gather: bool, precision: str) -> dict:
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=WithBuffer(), config=_config(stage, gather, precision))
    dtype = next(engine.module.parameters()).dtype
    for x, y in global_batches(2, MB * world):
        loss = F.mse_loss(
            engine(rank_slice(x, 0, rank, world, MB).to(dtype)).float(), rank_slice(y, 0, rank, world, MB)
        )
        engine.backward(loss)
        engine.step()
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    try:
        written = engine.save_16bit_model(out_dir, "model.safetensors")
        if gather:
            save_16bit_model(engine, out_dir, "trainable.safetensors", exclude_frozen_parameters=True)
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    return {"written": written, "state": state, "warnings": warnings}


@pytest.mark.parametrize(("stage", "precision"), [(3, "fp32"), (3, "bf16"), (1, "bf16"), (0, "fp32")])
def test_file_equals_module_state_dict(dist_run, tmp_path: Path, stage: int, precision: str) -> None:
    results = dist_run(_train_and_save, 2, str(tmp_path), stage, True, precision)
    assert [r["written"] for r in results] == [True, True]
    path = tmp_path / "model.safetensors"
    loaded = load_file(str(path))
    expected = results[0]["state"]
    assert sorted(loaded) == sorted(expected)  # tied weights under both names, the buffer, the frozen bias
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    assert loaded["mid.weight"].dtype == compute and loaded["step_ids"].dtype == torch.int64
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["shardspeed.tied"]) == [["mid.weight", "mid2.weight"]]
    assert not list(tmp_path.glob("*.tmp"))
    model = WithBuffer()
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in loaded.items()})  # strict
    assert sorted(load_file(str(tmp_path / "trainable.safetensors"))) == sorted(set(expected) - {"inp.bias"})


def test_stage3_without_the_flag_writes_nothing(dist_run, tmp_path: Path) -> None:
    results = dist_run(_train_and_save, 2, str(tmp_path), 3, False, "fp32")
    assert [r["written"] for r in results] == [False, False]
    assert not (tmp_path / "model.safetensors").exists()
    assert any("stage3_gather_16bit_weights_on_model_save" in w for w in results[0]["warnings"])


WIDTH, LAYERS = 32, 16


def _save_peak(rank: int, world: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, *_ = shardspeed.initialize(model=model, config=_config(3))
    tracker = MemTracker()
    with tracker:
        save_16bit_model(engine, out_dir, "model.safetensors")
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    largest_unit = max(u.padded_numel * u.shard.element_size() for u in engine.states.units)
    return {"peak": peak, "largest_unit": largest_unit}


def test_save_streams_one_unit_at_a_time(dist_run, tmp_path: Path) -> None:
    """Bytes allocated while saving stay at one gathered unit — two at worst: gloo's worker thread may still hold
    the previous unit's gathered buffer for a moment after wait() returns — far below the whole model."""
    full_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    for r in dist_run(_save_peak, 2, str(tmp_path)):
        bound = 2 * r["largest_unit"] + 1024
        assert r["peak"] <= bound, r
        assert full_bytes >= 6 * bound
    assert len(load_file(str(tmp_path / "model.safetensors"))) == 2 * LAYERS
