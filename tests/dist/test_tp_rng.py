"""Dropout streams on a real 2-rank tensor axis: different masks inside tensor-parallel regions, equal outside, and
the same masks replayed by an activation-checkpoint recompute of a tensor-parallel block whose saved input is
partitioned over the tensor axis (``partition_activations``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed import checkpointing
from shardspeed.checkpointing import RNGStatesTracker
from shardspeed.comm import Collectives
from shardspeed.comm.log import CommsLog
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.tensor_parallel.random import TensorParallelDropout, model_parallel_seed
from shardspeed.topology import MeshShape, Topology

H, B, S, P = 8, 2, 6, 0.5


def _expected(seed: int, n: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return F.dropout(torch.ones(n), P, training=True) != 0


def _masks(rank: int, world: int) -> dict:
    tp = TensorParallel.from_topology(Topology.build(MeshShape(tensor=world)))
    tracker = RNGStatesTracker()
    model_parallel_seed(tracker, tp, 42)
    ones = torch.ones(2000)
    split = TensorParallelDropout(P, tracker, "split")(ones) != 0
    replicated = TensorParallelDropout(P, tracker, "replicated")(ones) != 0
    return {"split": split, "replicated": replicated}


def test_split_regions_draw_different_masks_per_tensor_rank_and_replicated_ones_equal_masks(dist_run) -> None:
    masks = dist_run(_masks, 2)
    assert not torch.equal(masks[0]["split"], masks[1]["split"])
    assert torch.equal(masks[0]["replicated"], masks[1]["replicated"])
    for rank, m in enumerate(masks):  # the documented streams: seed + 2718 + tensor rank inside, seed outside
        assert torch.equal(m["split"], _expected(42 + 2718 + rank, 2000))
        assert torch.equal(m["replicated"], _expected(42, 2000))


class TPBlock(nn.Module):
    """A tensor-parallel MLP block with dropout in both kinds of region."""

    def __init__(self, tp: TensorParallel, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(H, 4 * H, tp)
        self.inner_drop = TensorParallelDropout(P, tracker, "split")  # this rank's 2H columns
        self.down = RowParallelLinear(4 * H, H, tp)
        self.outer_drop = TensorParallelDropout(P, tracker, "replicated")  # the all-reduced, replicated output
        self.seen: list[torch.Tensor] = []  # each dropout's mask, per run (forward or recompute), in call order
        # hooks, not code at the end of forward: torch's non-reentrant recompute stops once it has what backward
        # needs, which may be before the end of the block
        for drop in (self.inner_drop, self.outer_drop):
            drop.register_forward_hook(lambda _m, _i, out: self.seen.append(out.detach() == 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer_drop(self.down(self.inner_drop(F.gelu(self.up(x)))))


def _run(block: TPBlock, x: torch.Tensor, checkpointed: bool) -> dict:
    checkpointing.model_parallel_cuda_manual_seed(5)  # the default context's tracker: the one the block holds
    block.zero_grad(set_to_none=True)
    block.seen.clear()
    x = x.detach().requires_grad_()
    h = x
    for _ in range(2):  # two regions through the same block
        h = checkpointing.checkpoint(block, h) if checkpointed else block(h)
    h.square().sum().backward()
    return {
        "out": h.detach(),
        "x_grad": x.grad,
        "grads": [p.grad.clone() for p in block.parameters()],
        "seen": list(block.seen),
    }


def _checkpointed_tp_block(rank: int, world: int) -> dict:
    checkpointing.set_default_context(None)
    topology = Topology.build(MeshShape(tensor=world))
    log = CommsLog(enabled=True)
    checkpointing.configure(topology=topology, partition_activations=True, collectives=Collectives(log))
    tracker = checkpointing.get_cuda_rng_tracker()
    tp = TensorParallel(topology.tensor, Collectives(log))
    torch.manual_seed(0)
    block = TPBlock(tp, tracker)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    plain = _run(block, x, checkpointed=False)
    log.reset()
    ckpt = _run(block, x, checkpointed=True)
    # seeding by hand from the topology gives the same streams as the checkpointing context's seeding
    again = RNGStatesTracker()
    model_parallel_seed(again, tp, 5)
    with again.fork():
        ours = torch.rand(4)
    checkpointing.model_parallel_cuda_manual_seed(5)
    with tracker.fork():
        theirs = torch.rand(4)
    checkpointing.set_default_context(None)
    return {
        "plain": plain,
        "ckpt": ckpt,
        "log": {k: (t.count, t.elements) for k, t in log.totals.items()},
        "same_streams": torch.equal(ours, theirs),
    }


def test_checkpoint_recompute_of_a_tp_block_replays_the_masks_with_partitioned_inputs(dist_run) -> None:
    results = dist_run(_checkpointed_tp_block, 2)
    for r in results:
        plain, ckpt = r["plain"], r["ckpt"]
        assert r["same_streams"]
        assert torch.equal(plain["out"], ckpt["out"]) and torch.equal(plain["x_grad"], ckpt["x_grad"])
        assert all(torch.equal(a, b) for a, b in zip(plain["grads"], ckpt["grads"], strict=True))
        # forward of region 0 (inner, outer), region 1 (inner, outer), then the recomputes (region 1 first), which
        # stop inside the outer dropout (its mask is the last tensor backward needs, so its hook does not run; its
        # replay shows in the equal gradients): each inner mask replays its forward's, which is the plain run's
        assert len(ckpt["seen"]) == 6 and len(plain["seen"]) == 4
        assert all(torch.equal(a, b) for a, b in zip(ckpt["seen"][:4], plain["seen"], strict=True))
        assert torch.equal(ckpt["seen"][0], ckpt["seen"][5]) and torch.equal(ckpt["seen"][2], ckpt["seen"][4])
        # each region's saved input was split over the tensor axis (half kept per rank) and all-gathered back once
        # for its recompute; the recompute repeats each region's forward all-reduce (g), backward has one f each
        bsh = B * S * H
        assert r["log"] == {
            "all_reduce:tp.g.forward": (4, 4 * bsh),
            "all_gather:activation_checkpointing": (2, 2 * (bsh + 2 * 2)),  # + each rank's 2-float fingerprint
            "all_reduce:tp.f.backward": (2, 2 * bsh),
        }, r["log"]
    seen = [r["ckpt"]["seen"] for r in results]
    assert not torch.equal(seen[0][0], seen[1][0])  # split region (inner): the ranks' masks differ
    assert torch.equal(seen[0][1], seen[1][1])  # replicated region (outer): equal masks on both ranks


def _sequence_parallel_partitioned(rank: int, world: int) -> str:
    checkpointing.set_default_context(None)
    topology = Topology.build(MeshShape(tensor=world))
    checkpointing.configure(topology=topology, partition_activations=True)
    checkpointing.model_parallel_cuda_manual_seed(5)
    tp = TensorParallel(topology.tensor, sequence_parallel=True)
    torch.manual_seed(0)
    block = TPBlock(tp, checkpointing.get_cuda_rng_tracker())
    full = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    shard = full.chunk(world, dim=1)[rank].requires_grad_()  # this rank's sequence shard: not replicated
    out = checkpointing.checkpoint(block, shard)
    try:
        out.square().sum().backward()
    except ValueError as error:
        return str(error)
    finally:
        checkpointing.set_default_context(None)
    return "no error"


def test_partitioning_a_sequence_parallel_input_is_one_clear_error_on_every_rank(dist_run) -> None:
    errors = dist_run(_sequence_parallel_partitioned, 2)
    assert errors[0] == errors[1]  # the same verdict everywhere (no rank left waiting)
    assert "partition_activations: an input of shape (2, 3, 8) to a checkpointed region differs" in errors[0]
    assert "ranks [1] differ from rank 0" in errors[0] and "sequence parallelism" in errors[0]
