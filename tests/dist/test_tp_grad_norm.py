"""Gradient norm, clipping and Lamb with a tensor axis ([Note: norm counted once] in precision/norm_weights.py).

A small tensor-parallel MLP — a replicated LayerNorm, a ``ColumnParallelLinear`` and a ``RowParallelLinear``
(whose bias is replicated too) — against the dense single-process model built from the same global weights, at
ZeRO 0-3: the engine's ``get_global_grad_norm()`` equals the dense norm (≤1e-6 relative) with clipping active,
each replicated parameter counted once (the double-counted value is far outside the tolerance), and after 5 steps
every rank's slice equals the same slice of the dense parameters (≤1e-5), with AdamW and SGD; Lamb's trust ratios
come from the global parameters' norms. TP=2 (world 2) in the default suite, TP=2 × DP=2 (world 4) mostly slow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, optimizer_config, torch_optimizer
from torch import nn

from shardspeed.config import load_config
from shardspeed.engine import ShardSpeedEngine
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.topology import MeshShape, Topology

H, FF, MB, STEPS, LR = 8, 12, 4, 5, 0.05
CLIP = 0.3  # below every step's norm: clipping acts on each step
REPLICATED = ("norm.weight", "norm.bias", "down.bias")  # held whole by every tensor rank
TOL_NORM, TOL_PARAM = 1e-6, 1e-5


class DenseMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, FF)
        self.down = nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


class TPMLP(nn.Module):
    """DenseMLP with the two linears sliced over the tensor axis (Megatron's MLP: column then row)."""

    def __init__(self, dense: DenseMLP, tp: TensorParallel) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.norm.load_state_dict(dense.norm.state_dict())
        self.up = ColumnParallelLinear(H, FF, tp)
        self.up.load_dense(dense.up.weight, dense.up.bias)
        self.down = RowParallelLinear(FF, H, tp, input_is_parallel=True)
        self.down.load_dense(dense.down.weight, dense.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


def dense_model() -> DenseMLP:
    torch.manual_seed(0)
    model = DenseMLP()
    with torch.no_grad():  # a LayerNorm far from identity: its gradient weighs in the norm
        model.norm.weight.copy_(1.0 + torch.randn(H))
        model.norm.bias.copy_(0.5 * torch.randn(H))
    return model


def batches(global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(global_batch, H, generator=g), torch.randn(global_batch, H, generator=g)) for _ in range(STEPS)
    ]


def reference(kind: str, global_batch: int, clip: float = CLIP) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Dense training on the global batch: final parameters, and per step the norm and the squares of the
    replicated parameters' gradients (what a double count would add)."""
    model = dense_model()
    opt = torch_optimizer(kind, model.parameters(), LR)
    steps = []
    for x, y in batches(global_batch):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = dict(model.named_parameters())
        replicated_sq = sum(float(grads[n].grad.square().sum()) for n in REPLICATED)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        steps.append({"norm": norm, "replicated_sq": replicated_sq})
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, steps


def tp_engine(topology: Topology, config: dict[str, Any]) -> ShardSpeedEngine:
    model = TPMLP(dense_model(), TensorParallel.from_topology(topology))
    return ShardSpeedEngine(model, load_config(config, dp_world_size=topology.dp_world_size), topology)


def engine_config(stage: int, kind: str, clip: float = CLIP, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer_config(kind, LR),
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
        **extra,
    }


def tp_train(rank: int, world: int, stage: int, kind: str, tp: int, zero: dict | None = None) -> dict[str, Any]:
    topology = Topology.build(MeshShape(tensor=tp, data=world // tp))
    config = engine_config(stage, kind)
    config["zero_optimization"].update(zero or {})
    engine = tp_engine(topology, config)
    dp, dp_world = topology.dp_rank, topology.dp_world_size
    norms = []
    for x, y in batches(MB * dp_world):
        rows = slice(dp * MB, (dp + 1) * MB)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    params = full_params(engine)  # the dense model's tensors (gathered over the data and tensor axes)
    return {"tp_rank": topology.tp_rank, "tp": tp, "norms": norms, "params": params}


def check_against_reference(results: list[dict], kind: str, world: int, tp: int) -> None:
    ref_params, ref_steps = reference(kind, MB * (world // tp))
    for r in results:
        for step, (got, ref) in enumerate(zip(r["norms"], ref_steps)):
            assert got is not None
            assert abs(got - ref["norm"]) <= TOL_NORM * ref["norm"], (step, got, ref["norm"])
            # counting every tensor rank's replicated copies would give this; it must be far outside the tolerance
            doubled = (ref["norm"] ** 2 + (tp - 1) * ref["replicated_sq"]) ** 0.5
            assert abs(doubled - ref["norm"]) > 1000 * TOL_NORM * ref["norm"], (step, doubled, ref["norm"])
            assert abs(got - doubled) > 100 * TOL_NORM * ref["norm"]
            assert ref["norm"] > CLIP  # clipping acted
        for name, full in r["params"].items():
            torch.testing.assert_close(full, ref_params[name], rtol=TOL_PARAM, atol=TOL_PARAM, msg=name)


TP2_CASES = [(0, "adamw"), (1, "adamw"), (2, "adamw"), (3, "adamw"), (0, "sgd"), (3, "sgd")]
TP2_SLOW = [(1, "sgd"), (2, "sgd")]


@pytest.mark.parametrize(
    ("stage", "kind"), TP2_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in TP2_SLOW]
)
def test_tp2_norm_and_parameters_match_dense(dist_run, stage: int, kind: str) -> None:
    check_against_reference(dist_run(tp_train, 2, stage, kind, 2), kind, 2, 2)


def test_tp2_dp2_stage3_norm_and_parameters_match_dense(dist_run) -> None:
    """The representative world-4 case: the norm's all-reduce over the world (data shards × tensor slices)."""
    check_against_reference(dist_run(tp_train, 4, 3, "adamw", 2), "adamw", 4, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_dp2_norm_and_parameters_match_dense(dist_run, stage: int, kind: str) -> None:
    check_against_reference(dist_run(tp_train, 4, stage, kind, 2), kind, 4, 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_offload_optimizer_host_gradients(dist_run, stage: int) -> None:
    """``offload_optimizer``: the norm is the stage's (device gradients), the clip scales the host copies."""
    offload = {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 37}
    check_against_reference(dist_run(tp_train, 2, stage, "adamw", 2, offload), "adamw", 2, 2)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_tp2_lamb_trust_ratios_from_global_parameters(dist_run, stage: int) -> None:
    """Lamb's per-tensor trust ratio of a sliced weight is that of the dense weight: its norms summed over the
    tensor axis; the replicated parameters' norms are not doubled."""
    check_against_reference(dist_run(tp_train, 2, stage, "lamb", 2), "lamb", 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_tp2_dp2_lamb_trust_ratios_from_global_parameters(dist_run, stage: int) -> None:
    check_against_reference(dist_run(tp_train, 4, stage, "lamb", 2), "lamb", 4, 2)


def _norm_traffic(rank: int, world: int, stage: int, tp: int, kind: str) -> dict[str, tuple[int, int]]:
    topology = Topology.build(MeshShape(tensor=tp, data=world // tp))
    engine = tp_engine(topology, engine_config(stage, kind, comms_logger={"enabled": True}))
    dp = topology.dp_rank
    for x, y in batches(MB * topology.dp_world_size):
        rows = slice(dp * MB, (dp + 1) * MB)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    totals = engine.comms_log.totals
    return {tag: (totals[f"all_reduce:{tag}"].count, totals[f"all_reduce:{tag}"].elements) for tag in TAGS}


TAGS = ("grad_norm", "lamb_norms")
PARAMS = 6  # norm.weight, norm.bias, up.weight, up.bias, down.weight, down.bias


@pytest.mark.parametrize(
    ("world", "tp", "stage", "kind", "expected"),
    [
        # data-parallel only: as cheap as before the tensor axis (no norm collective at stage 0, one at stage 1)
        (2, 1, 0, "adamw", {"grad_norm": (0, 0), "lamb_norms": (0, 0)}),
        (2, 1, 1, "adamw", {"grad_norm": (STEPS, STEPS), "lamb_norms": (0, 0)}),
        # TP=2: one scalar all-reduce per step (model scope at stage 0, world at stage 1)
        (2, 2, 0, "adamw", {"grad_norm": (STEPS, STEPS), "lamb_norms": (0, 0)}),
        (2, 2, 1, "adamw", {"grad_norm": (STEPS, STEPS), "lamb_norms": (0, 0)}),
        # Lamb: one table of (||w||², ||r||²) per parameter per step, whatever the stage
        (2, 2, 0, "lamb", {"grad_norm": (STEPS, STEPS), "lamb_norms": (STEPS, STEPS * 2 * PARAMS)}),
        (2, 2, 3, "lamb", {"grad_norm": (STEPS, STEPS), "lamb_norms": (STEPS, STEPS * 2 * PARAMS)}),
    ],
)
def test_norm_collectives_counted(dist_run, world: int, tp: int, stage: int, kind: str, expected: dict) -> None:
    for traffic in dist_run(_norm_traffic, world, stage, tp, kind):
        assert traffic == expected
