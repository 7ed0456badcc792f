"""Activation checkpointing across ranks: the RNG tracker on a 2-rank tensor axis, partitioned activations, and
checkpointed training under the engine (ZeRO-2 with gradient accumulation; ZeRO-3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import shardspeed
from shardspeed import checkpointing
from shardspeed.comm.collectives import Collectives
from shardspeed.comm.log import CommsLog
from shardspeed.topology import MeshShape, Topology

H, L, N, P_DROP = 16, 4, 64, 0.25


def make_blocks(n: int = L) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Dropout(P_DROP), nn.Linear(4 * H, H)) for _ in range(n)
    )


class WorldMpu:
    """A Megatron-style mpu whose model-parallel group is the whole world."""

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD


# ------------------------------------------------------------------------------------------------ RNG tracker


def _dropout_masks(rank: int, world: int) -> dict:
    checkpointing.set_default_context(None)
    checkpointing.configure(topology=Topology.build(MeshShape(tensor=2)))
    checkpointing.model_parallel_cuda_manual_seed(42)
    ones = torch.ones(4000)
    with checkpointing.get_cuda_rng_tracker().fork():
        inside = F.dropout(ones, 0.5, training=True) != 0
    outside = F.dropout(ones, 0.5, training=True) != 0
    return {"inside": inside, "outside": outside, "region": [_forked_region(c) for c in (False, True)]}


def _forked_region(checkpointed: bool) -> tuple[torch.Tensor, ...]:
    """A region whose dropout runs in the model-parallel stream, plain or checkpointed, from the same seeds."""
    torch.manual_seed(0)
    linear = nn.Linear(H, H)
    x = torch.randn(8, H, requires_grad=True)
    checkpointing.model_parallel_cuda_manual_seed(5)

    def region(h: torch.Tensor) -> torch.Tensor:
        with checkpointing.get_cuda_rng_tracker().fork():
            return F.dropout(linear(h), 0.5, training=True)

    out = checkpointing.checkpoint(region, x) if checkpointed else region(x)
    out.square().sum().backward()
    return out.detach(), linear.weight.grad, x.grad


def _expected_mask(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return F.dropout(torch.ones(4000), 0.5, training=True) != 0


def test_dropout_masks_differ_inside_the_model_parallel_region_and_agree_outside(dist_run) -> None:
    masks = dist_run(_dropout_masks, 2)
    assert not torch.equal(masks[0]["inside"], masks[1]["inside"])
    assert torch.equal(masks[0]["outside"], masks[1]["outside"])
    for rank, m in enumerate(masks):  # the streams are the documented ones: seed, and seed + 2718 + tensor rank
        assert torch.equal(m["outside"], _expected_mask(42))
        assert torch.equal(m["inside"], _expected_mask(42 + 2718 + rank))
        plain, ckpt = m["region"]
        assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))  # the recompute replays the rank's own mask
    assert not torch.equal(masks[0]["region"][1][0], masks[1]["region"][1][0])  # and the ranks' masks differ


# ------------------------------------------------------------------------------------------------ partitioning


def _forward_backward(blocks: nn.ModuleList, x: torch.Tensor, ctx: checkpointing.CheckpointingContext | None) -> dict:
    torch.manual_seed(7)  # same dropout masks on both ranks: block inputs stay replicated, as partitioning assumes
    blocks.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    h = x
    for block in blocks:
        h = block(h) if ctx is None else ctx.checkpoint(block, h)
    h.square().mean().backward()
    return {"out": h.detach(), "grads": [p.grad.clone() for p in blocks.parameters()], "x_grad": x.grad}


def _saved_input_bytes(blocks: nn.ModuleList, x: torch.Tensor, ctx: checkpointing.CheckpointingContext) -> int:
    """Bytes alive after a checkpointed forward, less the output: the stored inputs of the L regions."""
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    with tracker:
        base = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        out = checkpointing.run_blocks(blocks, x * 1.0, context=ctx)  # block 0's input: held by its store only
        alive = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"] - base
    out.sum().backward()  # the backward all-gathers: every rank must run it
    return alive - out.numel() * out.element_size()


def _partitioned(rank: int, world: int, via: str) -> dict:
    checkpointing.set_default_context(None)
    topology = Topology.build(MeshShape(tensor=2))
    log = CommsLog(enabled=True)
    mpu = WorldMpu() if via == "mpu" else None
    ctx = checkpointing.configure(
        mpu, partition_activations=True, topology=topology if via == "topology" else None, collectives=Collectives(log)
    )
    assert ctx.tensor_axis.size == 2 and ctx.tensor_axis.rank == rank
    blocks, x = make_blocks(), torch.randn(N, H, generator=torch.Generator().manual_seed(1))
    plain = _forward_backward(blocks, x, None)
    partitioned = _forward_backward(blocks, x, ctx)
    gathers = log.totals["all_gather:activation_checkpointing"].count
    whole = checkpointing.CheckpointingContext(tensor_axis=topology.tensor)
    return {
        "plain": plain,
        "partitioned": partitioned,
        "gathers": gathers,
        "saved_whole": _saved_input_bytes(blocks, x, whole),
        "saved_partitioned": _saved_input_bytes(blocks, x, ctx),
        "b_in": x.numel() * x.element_size(),
    }


@pytest.mark.parametrize("via", ["topology", "mpu"])
def test_partition_activations_over_a_2_rank_tensor_axis(dist_run, via: str) -> None:
    for r in dist_run(_partitioned, 2, via):
        plain, part = r["plain"], r["partitioned"]
        assert torch.equal(plain["out"], part["out"]) and torch.equal(plain["x_grad"], part["x_grad"])
        assert all(torch.equal(a, b) for a, b in zip(plain["grads"], part["grads"], strict=True))
        assert r["gathers"] == L  # each region's input was gathered back once, for its recompute
        assert r["saved_whole"] == L * r["b_in"]
        assert r["saved_partitioned"] <= (0.5 + 0.05) * r["saved_whole"], r


# ------------------------------------------------------------------------------------------------ engine


class BlockNet(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, H)
        self.blocks = make_blocks(3)
        self.out = nn.Linear(H, 2)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.checkpointed:
            h = checkpointing.run_blocks(self.blocks, h)  # the default context: configured below, after initialize
        else:
            for block in self.blocks:
                h = block(h)
        return self.out(h)


STEPS, MB, GAS = 3, 2, 2


def _train(rank: int, world: int, stage: int, checkpointed: bool) -> dict:
    model = BlockNet(checkpointed)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "activation_checkpointing": {"cpu_checkpointing": True},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    checkpointing.set_default_context(None)
    checkpointing.configure(deepspeed_config=config, topology=engine.topology)
    data = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(10 + rank)  # dropout masks differ per rank, and are the same in both runs
    losses = []
    for _ in range(STEPS):
        for _ in range(GAS):
            x, y = torch.randn(MB, 5, generator=data), torch.randn(MB, 2, generator=data)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    engine.states.wait_params()  # stages 1/2 overlap the last step's parameter gathers with the next forward
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if stage == 3:
        params = engine.module_state_dict()
    return {"params": params, "losses": losses}


def _both(rank: int, world: int, stage: int) -> dict:
    return {"plain": _train(rank, world, stage, False), "checkpointed": _train(rank, world, stage, True)}


def _assert_identical_training(results: list[dict]) -> None:
    initial = dict(BlockNet(False).named_parameters())
    for r in results:
        plain, ckpt = r["plain"], r["checkpointed"]
        assert plain["losses"] == ckpt["losses"]
        assert plain["params"].keys() == ckpt["params"].keys()
        for name, p in plain["params"].items():
            assert torch.equal(p, ckpt["params"][name]), name
        assert max((plain["params"][n] - initial[n]).abs().max().item() for n in initial) > 1e-3  # it trained


def test_zero2_with_gradient_accumulation_checkpointed_equals_plain(dist_run) -> None:
    _assert_identical_training(dist_run(_both, 2, 2))


def test_zero3_checkpointed_equals_plain(dist_run) -> None:
    """Under ZeRO-3 the recompute re-runs each block's hooks, which re-gather its parameters."""
    _assert_identical_training(dist_run(_both, 2, 3))
