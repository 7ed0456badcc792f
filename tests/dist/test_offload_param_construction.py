"""``offload_param`` bounds construction too ([Note: offload during construction] in zero/stage3/early_offload.py):
under ``zero.Init`` each unit's shard goes to the parameter store as soon as that unit is materialized and
sharded, before the next unit has values — not all at once after the stage was built — and the result is the
same model (values, then training) as without offload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from parity import OFFLOAD_AIO

import shardspeed
from harness import error_of
from shardspeed import zero
from shardspeed.faults.inject import ENV_VAR
from shardspeed.zero.stage3 import states as states_module
from shardspeed.zero.stage3.param_offload import ParamOffloader

WIDTH, LAYERS = 16, 4


def _config(tmp: str | None, precision: str) -> dict:
    zero_cfg: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if tmp is not None:
        zero_cfg["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "p"), "max_in_cpu": 0}
        if precision in ("fp32", "bf16+opt"):  # fp32 offload_param needs the streamed optimizer (param_offload.py)
            zero_cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "o")}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "zero_optimization": zero_cfg,
        "bf16": {"enabled": precision.startswith("bf16")},
        "aio": OFFLOAD_AIO,
        "steps_per_print": 1000,
    }


def _build(tmp: str | None, precision: str, build: str, writes: list[tuple[str, int]]) -> shardspeed.ShardSpeedEngine:
    torch.manual_seed(0)
    with zero.Init(enabled=build == "zero_init"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    original = ParamOffloader.write
    upcast = states_module._upcast

    def recording(self: ParamOffloader, unit: object, shard: torch.Tensor) -> None:
        # how many of the model's parameters are not sharded yet (meta, or whole) when this unit's shard is written
        writes.append((self.key(unit), sum(p.numel() > 0 for p in model.parameters())))
        original(self, unit, shard)

    def counting(unit: object, dtype: torch.dtype) -> torch.Tensor:
        writes.append(("master", 0))  # an fp32 master shard built in memory
        return upcast(unit, dtype)

    ParamOffloader.write, states_module._upcast = recording, counting  # this forked rank only
    try:
        engine, *_ = shardspeed.initialize(model=model, config=_config(tmp, precision))
    finally:
        ParamOffloader.write, states_module._upcast = original, upcast
    return engine


def _train(engine: shardspeed.ShardSpeedEngine, rank: int) -> list[float]:
    g = torch.Generator().manual_seed(5 + rank)
    losses = []
    for _ in range(3):
        x = torch.randn(2, WIDTH, generator=g)
        loss = (engine(x.to(engine.module[0].weight.dtype)).float() ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _run(rank: int, world: int, tmp: str, precision: str, build: str) -> dict:
    writes: list[tuple[str, int]] = []
    offloaded = _build(tmp, precision, build, writes)
    built = {k: v.float().clone() for k, v in offloaded.module_state_dict().items()}
    resident = [u.shard_resident for u in offloaded.states.units if not u.persistent]
    losses = _train(offloaded, rank)
    trained = {k: v.float().clone() for k, v in offloaded.module_state_dict().items()}
    offloaded.destroy()
    plain = _build(None, precision, build, [])
    plain_built = {k: v.float().clone() for k, v in plain.module_state_dict().items()}
    plain_losses = _train(plain, rank)
    plain_trained = {k: v.float().clone() for k, v in plain.module_state_dict().items()}
    plain.destroy()
    return {
        "writes": [w for w in writes if w[0] != "master"][:LAYERS],
        "masters_built": sum(w[0] == "master" for w in writes),
        "resident": resident,
        "built": (built, plain_built),
        "trained": (trained, plain_trained),
        "losses": (losses, plain_losses),
    }


@pytest.mark.parametrize("build", ["zero_init", "normal"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16+opt"])
def test_each_unit_offloaded_as_it_is_sharded(dist_run, tmp_path: Path, precision: str, build: str) -> None:
    """zero.Init: unit k's shard is written while units k+1.. are still meta; a normally built model: while they
    are still whole (the user's memory) and only unit k's shard exists besides them."""
    for r in dist_run(_run, 2, str(tmp_path), precision, build):
        # 2 parameters per layer; the old order wrote every shard after the last unit was sharded, i.e.
        # [("unit0", 0), ("unit1", 0), ...]
        assert r["writes"] == [(f"unit{k}", 2 * (LAYERS - 1 - k)) for k in range(LAYERS)]
        assert r["resident"] == [False] * LAYERS  # nothing of them in memory once built
        # fp32 masters: none with a streamed optimizer to hold them (bf16+opt), else one per unit (bf16)
        assert r["masters_built"] == (LAYERS if precision == "bf16" else 0)
        built, plain_built = r["built"]
        for name, value in plain_built.items():
            assert torch.equal(built[name], value), name  # the same values as materialized without offload
        trained, plain_trained = r["trained"]
        for name, value in plain_trained.items():
            assert (trained[name] - value).abs().max().item() <= 1e-5, name
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-5)


def _setup_fails(rank: int, world: int, tmp: str) -> dict:
    os.environ[ENV_VAR] = "offload_setup:enospc:rank=1"
    try:
        torch.manual_seed(0)
        with zero.Init():
            model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        error = error_of(lambda: shardspeed.initialize(model=model, config=_config(tmp, "fp32")))
    finally:
        os.environ.pop(ENV_VAR, None)
    return {
        "error": error,
        "meta": all(p.is_meta for p in model.parameters()),
        "left": sorted(os.listdir(os.path.join(tmp, "p"))),
    }


def test_param_store_setup_failure_is_agreed_before_materializing(dist_run, tmp_path: Path) -> None:
    """The parameter store now opens before any unit has values: an ENOSPC on one rank is still one agreed error on
    every rank (offload/setup.py), raised before anything was materialized, and no swap file is left."""
    for r in dist_run(_setup_fails, 2, str(tmp_path)):
        assert r["error"].startswith("SwapSetupError: zero_optimization.offload_param.nvme_path = "), r["error"]
        assert "unusable on data-parallel rank 1" in r["error"] and "No space left on device" in r["error"]
        assert r["meta"]  # the old order materialized every unit before opening the store
        assert r["left"] == []  # nothing under nvme_path
