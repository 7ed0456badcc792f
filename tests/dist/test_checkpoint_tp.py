"""N-d checkpoints: saved at one mesh (tensor × data) and ZeRO stage, loaded at another; parameters and Adam
moments equal the saving run's global values, training continues with the saving run's losses; zero-to-fp32 gives
the global tensors; today's DP-only checkpoints still load."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from shardspeed.checkpoint import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardspeed.config.load import load_config
from shardspeed.engine import ShardSpeedEngine
from shardspeed.params.assemble import place_box
from shardspeed.params.spec import ParamSpec
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.topology import MeshShape, Topology
from shardspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from shardspeed.zero.api import full_shape

IN, HID, OUT, BATCH = 6, 5, 4, 4  # HID=5 per fused part: TP=2 slices of 3 and 2 rows (ceil chunks)
FIXTURE = Path(__file__).parents[1] / "fixtures" / "checkpoints" / "dp_only_v1"


class Net(torch.nn.Module):
    """A tensor-replicated layer norm, a fused (2-part) column-parallel layer split on dim 0, and a row-parallel
    layer split on dim 1 (its boxes are not contiguous in the flat order)."""

    def __init__(self, tp: TensorParallel, hid: int = HID) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(IN)
        self.up = ColumnParallelLinear(IN, 2 * hid, tp, parts=2)
        self.down = RowParallelLinear(2 * hid, OUT, tp, parts=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _engine(tp: int, dp: int, stage: int, hid: int = HID) -> ShardSpeedEngine:
    topology = Topology.build(MeshShape(tensor=tp, data=dp))
    torch.manual_seed(0)
    model = Net(TensorParallel.from_topology(topology), hid)
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // dp,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 16, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    return ShardSpeedEngine(model, load_config(config, dp_world_size=dp), topology)


def _train(engine: ShardSpeedEngine, steps: int) -> list[float]:
    dp, r = engine.topology.dp_world_size, engine.topology.dp_rank
    losses = []
    for _ in range(steps):
        x, y = _batch(engine.global_steps)
        mine = slice(r * BATCH // dp, (r + 1) * BATCH // dp)
        loss = F.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine: ShardSpeedEngine) -> dict:
    """This rank's whole local (TP-sliced) parameters and Adam moments, with their specs (collective)."""
    out: dict = {"tp": engine.topology.tp_rank, "tp_size": engine.topology.tp_world_size, "dp": engine.topology.dp_rank}
    for name, p in engine.module.named_parameters():
        out[name] = {
            "spec": engine.param_specs.by_name(name) or ParamSpec(tuple(full_shape(p))),  # ZeRO-3: not the placeholder
            "param": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        }
    return out


def _run(rank: int, world: int, tp: int, stage: int, before: int, save: str | None, load: str | None, after: int):
    engine = _engine(tp, world // tp, stage)
    if load is not None:
        path, _ = engine.load_checkpoint(load)
        assert path is not None
    losses = _train(engine, before)
    if save is not None:
        engine.save_checkpoint(save)
    snapshot = _snapshot(engine)
    return {"snapshot": snapshot, "losses": losses + _train(engine, after), "steps": engine.global_steps}


def _global(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's and moment's global tensor, placed from the data-rank-0 copies of every tensor rank."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for result in results:
        snap = result["snapshot"]
        if snap["dp"] != 0:
            continue
        for name, held in snap.items():
            if not isinstance(held, dict):
                continue
            spec: ParamSpec = held["spec"]
            for key in ("param", "exp_avg", "exp_avg_sq"):
                full = out.setdefault(name, {}).setdefault(key, torch.full(spec.global_shape, float("nan")))
                for box in spec.boxes(snap["tp"], snap["tp_size"]):  # NaN-filled: an uncovered element shows
                    place_box(held[key], box, full)
    return out


def _mean_losses(results: list[dict]) -> list[float]:
    """The global loss per step: the mean over data ranks (equal micro-batches) of tensor rank 0's losses."""
    rows = [r["losses"] for r in results if r["snapshot"]["tp"] == 0]
    return [sum(step) / len(step) for step in zip(*rows)]


def _check_resharded(saved: list[dict], loaded: list[dict]) -> None:
    want, got = _global(saved), _global(loaded)
    assert want.keys() == got.keys()
    for name in want:
        for key in want[name]:
            assert not torch.isnan(want[name][key]).any(), (name, key)
            torch.testing.assert_close(got[name][key], want[name][key], rtol=0, atol=0, msg=f"{name} {key}")
    before = len(saved[0]["losses"]) - len(loaded[0]["losses"])  # steps the saving run took before its save
    torch.testing.assert_close(_mean_losses(loaded), _mean_losses(saved)[before:], rtol=1e-5, atol=1e-6)


def test_tp2_dp2_checkpoint_loads_at_tp1_dp1_and_consolidates(dist_run, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = dist_run(_run, 4, 2, 1, 3, ckpt, None, 2)  # TP=2 × DP=2, ZeRO-1
    loaded = dist_run(_run, 1, 1, 0, 0, None, ckpt, 2)  # TP=1 × DP=1, stage 0
    _check_resharded(saved, loaded)
    meta = json.loads((tmp_path / "ckpt" / "global_step3" / "metadata.json").read_text())["metadata"]
    assert meta["mesh"] == {"pipe": 1, "data": 2, "tensor": 2}
    assert meta["params"]["down.weight"] == {"global_shape": [OUT, 2 * HID], "partition_dim": 1, "parts": 2}
    assert len(meta["rng"]) == 4  # one per global rank
    # zero-to-fp32: the global tensors, loadable by an unsliced model
    want = _global(saved)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert state.keys() == want.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, want[name]["param"], rtol=0, atol=0)
    written = convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "fp32")  # the streaming CLI path
    for name, tensor in load_file(str(written[0])).items():
        torch.testing.assert_close(tensor, want[name]["param"], rtol=0, atol=0)
    dense = Net(TensorParallel(Topology.build(MeshShape()).tensor))
    load_state_dict_from_zero_checkpoint(dense, ckpt)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(p.detach(), want[name]["param"], rtol=0, atol=0)


def test_tp2_checkpoint_loads_at_tp1_dp2(dist_run, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = dist_run(_run, 2, 2, 0, 3, ckpt, None, 2)  # TP=2, stage 0
    loaded = dist_run(_run, 2, 1, 2, 0, None, ckpt, 2)  # TP=1 × DP=2, ZeRO-2
    _check_resharded(saved, loaded)
    index = json.loads((tmp_path / "ckpt" / "global_step3" / "index.json").read_text())["tensors"]
    # the layer norm is held alike by both tensor ranks and written once; the sliced weight as two boxes per part
    assert len(index["param/norm.weight"]["chunks"]) == 1
    boxes = {tuple(c["box_offset"]) for c in index["param/down.weight"]["chunks"]}
    assert boxes == {(0, 0), (0, 3), (0, HID), (0, HID + 3)}


def test_tp1_checkpoint_loads_at_tp2(dist_run, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = dist_run(_run, 2, 1, 3, 3, ckpt, None, 2)  # TP=1 × DP=2, ZeRO-3
    loaded = dist_run(_run, 2, 2, 1, 0, None, ckpt, 2)  # TP=2, ZeRO-1
    _check_resharded(saved, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("world", "tp", "offset"), [(1, 1, 3), (4, 1, 2), (2, 2, 0), (4, 2, 1)])
def test_tp2_dp2_checkpoint_reshards(dist_run, tmp_path: Path, stage: int, world: int, tp: int, offset: int):
    """Saved at TP=2 × DP=2 at every stage; loaded at TP=1 × DP=1, TP=1 × DP=4, TP=2 × DP=1 and TP=2 × DP=2, the
    load stage rotated (``(stage + offset) % 4``) so every target mesh loads at every ZeRO stage and every saved
    stage is loaded at four different stages."""
    load_stage = (stage + offset) % 4
    ckpt = str(tmp_path / "ckpt")
    saved = dist_run(_run, 4, 2, stage, 3, ckpt, None, 2)
    loaded = dist_run(_run, world, tp, load_stage, 0, None, ckpt, 2)
    _check_resharded(saved, loaded)


def _load_other_shape(rank: int, world: int, ckpt: str) -> str:
    engine = _engine(world, 1, 1, hid=HID + 1)
    try:
        engine.load_checkpoint(ckpt)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_global_shape_mismatch_is_named_on_every_rank(dist_run, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    dist_run(_run, 2, 2, 0, 1, ckpt, None, 0)
    messages = dist_run(_load_other_shape, 2, ckpt)
    assert messages[0] == messages[1]
    # global shapes, not the TP slices
    pattern = r"parameter '(up|down)\.weight' is \((10, 6|4, 10)\) in checkpoint \S+ but \((12, 6|4, 12)\) in this"
    assert re.search(pattern, messages[0]), messages[0]


def _load_fixture(rank: int, world: int, stage: int) -> dict:
    sys.path.insert(0, str(FIXTURE.parent))
    from make_dp_only_v1 import fixture_model

    model = fixture_model()
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4 // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    engine = ShardSpeedEngine(model, load_config(config, dp_world_size=world), Topology.build(MeshShape(data=world)))
    path, _ = engine.load_checkpoint(str(FIXTURE))
    assert path is not None and engine.global_steps == 2
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"param/{name}"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


@pytest.mark.parametrize(("world", "stage"), [(1, 0), (2, 3)])
def test_dp_only_v1_checkpoint_still_loads(dist_run, world: int, stage: int) -> None:
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    for got in dist_run(_load_fixture, world, stage):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
