"""Tensor parallelism with a model built under ``zero.Init`` (meta construction, materialized unit by unit by
ZeRO-3): partial-gradient hooks on the materialized parameters, tensor-replicated parameters equal on every tensor
rank even when ranks were seeded differently, and AutoTP refused alike on every rank."""

from __future__ import annotations

import pytest
import torch
from test_tp_parity import _batches, _config, _dense, _global, _loss, _reference
from tp_gpt import TPGPT, GPTConfig

import shardspeed
from shardspeed import zero
from shardspeed.params import ParamSpecs
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.topology import MeshShape, Topology

TOL = 1e-5
GPT_CFG = GPTConfig()


def _build(topology: Topology, seed: int, *, sp: bool, under_init: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    tp = TensorParallel.from_topology(topology, sequence_parallel=sp)
    if not under_init:
        return TPGPT(GPT_CFG, tp)
    with zero.Init():
        return TPGPT(GPT_CFG, tp)


def _train_under_init(rank: int, world: int, opt: str) -> tuple[float, float, int, int]:
    """TPGPT at TP=2 with sequence parallelism built under zero.Init, ZeRO-3, 5 steps: (largest difference from the
    dense reference, how far the reference moved, ``tp.partial_grad`` all-reduces logged, expected count)."""
    tp, dp, steps = 2, world // 2, 5
    topology = Topology.build(MeshShape(tensor=tp, data=dp))
    model = _build(topology, 0, sp=True, under_init=True)
    config = {**_config(3, opt, 1, {}), "comms_logger": {"enabled": True}}
    engine, *_ = shardspeed.initialize(model=model, mpu=topology, config=config)
    batches = _batches("gpt", dp, 1)
    engine.comms_log.reset()
    for tokens in batches:
        row = engine.topology.data.rank * 2
        engine.backward(_loss("gpt", engine, tokens[row : row + 2]))
        engine.step()
    totals = engine.comms_log.totals
    logged = totals["all_reduce:tp.partial_grad"].count if "all_reduce:tp.partial_grad" in totals else 0
    # expected: one all-reduce per partial-gradient parameter per backward, counted on a normally built twin
    twin = _build(topology, 0, sp=True, under_init=False)
    specs = ParamSpecs.collect(twin, topology.tensor.rank, tp)
    partial = sum(1 for _, p in twin.named_parameters() if specs.of(p).partial_grad)
    got = _global(engine)
    expected = _reference("gpt", opt, batches, 1)
    start = {n: p.detach() for n, p in _dense("gpt").named_parameters()}
    diff = max((got[n] - expected[n]).abs().max().item() for n in expected)
    return diff, max((expected[n] - start[n]).abs().max().item() for n in expected), logged, steps * partial


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_zero_init_tp_sp_matches_dense(dist_run, opt: str) -> None:
    """Bug 1: the partial-gradient hooks sit on zero.Init's materialized parameters (registered after the stage),
    so the sequence-parallel norms' gradients are summed and training matches the dense model."""
    results = dist_run(_train_under_init, 2, opt)
    for diff, moved, logged, expected in results:
        assert logged == expected > 0, results
        assert diff <= TOL, results
        assert moved > 100 * TOL, results


def _offload_nvme(tmp: str) -> dict:
    """ZeRO-3 with parameters and optimizer on NVMe (fp32): each unit's shard goes to the swap file as soon as it is
    materialized, after its tensor-replica sync ([Note: offload during construction])."""
    return {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": f"{tmp}/p", "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": f"{tmp}/o"},
        },
        "aio": {"block_size": 4096, "queue_depth": 4, "thread_count": 2},
    }


def _seeded_apart(rank: int, world: int, tmp: str | None = None) -> dict[str, dict[str, float]]:
    """Every rank seeded differently (100 + global rank), the model built under zero.Init, TP=2 × DP=2, ZeRO-3.
    Returns how far each parameter is from what it should be: replicated ones from global rank 0's build (tensor
    rank 0 of data rank 0), sliced ones from a normal build on this tensor rank with data rank 0's seed (global
    rank = tensor rank: tensor innermost), i.e. this tensor rank's slice of that seed's global draw."""
    topology = Topology.build(MeshShape(tensor=2, data=world // 2))
    model = _build(topology, 100 + rank, sp=False, under_init=True)
    config = _config(3, "adamw", 1, _offload_nvme(tmp)) if tmp is not None else _config(3, "sgd", 1, {})
    engine, *_ = shardspeed.initialize(model=model, mpu=topology, config=config)
    full = {n: t.float() for n, t in engine.module_state_dict().items()}  # the dense model's tensors
    tensor = engine.topology.tensor

    def normal(seed: int) -> tuple[dict[str, torch.Tensor], ParamSpecs]:
        built = _build(topology, seed, sp=False, under_init=False)
        return dict(built.named_parameters()), ParamSpecs.collect(built, tensor.rank, tensor.size)

    replica_source, _ = normal(100)
    slice_source, specs = normal(100 + tensor.rank)
    out: dict[str, dict[str, float]] = {"replicated": {}, "sliced": {}}
    for name, p in slice_source.items():
        if specs.of(p, name).partitioned:
            mine = specs.of(p, name).slice_global(full[name], tensor.rank, tensor.size)  # this rank's slice
            out["sliced"][name] = (mine - p.detach()).abs().max().item()
        else:
            out["replicated"][name] = (full[name] - replica_source[name].detach()).abs().max().item()
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "nvme"])
def test_replicated_parameters_agree_across_tensor_ranks_under_zero_init(dist_run, tmp_path, offload: bool) -> None:
    """Bug 2: ranks seeded differently, built under zero.Init → every tensor-replicated parameter equals tensor
    rank 0's (here global rank 0's, after the data-axis broadcast), exactly; each sliced one is its tensor rank's
    own slice of its (data rank 0's) global draw. Also with each shard offloaded to NVMe as it is materialized."""
    results = dist_run(_seeded_apart, 4, str(tmp_path) if offload else None)
    for r in results:
        assert r["replicated"] and r["sliced"], r
        assert max(r["replicated"].values()) == 0.0, r["replicated"]
        assert max(r["sliced"].values()) == 0.0, r["sliced"]


class _WithBuffer(torch.nn.Module):
    """No TP layers: everything replicated over the tensor axis, including a random buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("noise", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum() + self.noise.sum()


def _buffer_seeded_apart(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    topology = Topology.build(MeshShape(tensor=2, data=world // 2))
    torch.manual_seed(100 + rank)
    with zero.Init():
        model = _WithBuffer()
    engine, *_ = shardspeed.initialize(model=model, mpu=topology, config=_config(3, "sgd", 1, {}))
    state = {n: t.clone() for n, t in engine.module_state_dict().items()}
    return engine.collectives.all_gather_object(state, engine.topology.tensor)


def test_replicated_buffers_agree_across_tensor_ranks_under_zero_init(dist_run) -> None:
    """Bug 2, buffers: a random buffer (and undeclared parameters) built under zero.Init with different seeds is
    tensor rank 0's on every tensor rank."""
    for everyone in dist_run(_buffer_seeded_apart, 2):
        assert set(everyone[0]) == {"linear.weight", "linear.bias", "noise"}
        for name, value in everyone[0].items():
            assert torch.equal(value, everyone[1][name]), name


def _autotp_under_init(rank: int, world: int, which: str) -> str:
    """GPT-2 with ``tensor_parallel.autotp_size`` 2, built under zero.Init on every rank or on rank 1 only."""
    from test_tp_parity import _hf

    torch.manual_seed(0)
    if which == "all" or rank == 1:
        with zero.Init():
            model = _hf("gpt2")
    else:
        model = _hf("gpt2")
    config = _config(3, "sgd", 1, {"tensor_parallel": {"autotp_size": 2}})
    try:
        shardspeed.initialize(model=model, config=config)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("which", [pytest.param("all", marks=pytest.mark.slow), "one"])
def test_autotp_under_zero_init_refused_alike(dist_run, which: str) -> None:
    """Bug 3: AutoTP cannot slice meta parameters; the refusal is the same NotImplementedError on every rank, also
    when only some ranks built the model under zero.Init (the others would otherwise wait in a collective)."""
    pytest.importorskip("transformers")
    messages = dist_run(_autotp_under_init, 2, which)
    assert len(set(messages)) == 1, messages
    message = messages[0]
    assert message.startswith("NotImplementedError") and "zero.Init" in message and "AutoTP" in message, message
    assert ("rank(s) 0, 1:" if which == "all" else "rank(s) 1:") in message, message
