"""PipelineModule across processes: each stage builds only its layers under global-index names, tied weights get
their groups and start equal, and a forward/backward passed between the stages by hand (plain torch.distributed
send/recv in the test) equals the PP=1 module's — values, and gradients once the tied copies' are summed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import error_of
from shardspeed.comm.collectives import Collectives
from shardspeed.comm.log import CommsLog
from shardspeed.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    TiedLayerSpec,
)
from shardspeed.topology import MeshShape, Topology

VOCAB, DIM = 11, 6
BUILT: list[str] = []  # classes built with real storage in this process (meta builds only count parameters)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        if not self.fc.weight.is_meta:
            BUILT.append(type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class FirstBlock(Block):
    pass


class LastBlock(Block):
    pass


def _head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def _layers() -> list[Any]:
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        LayerSpec(FirstBlock, DIM),
        LayerSpec(Block, DIM),
        lambda x: x * 0.5,
        LayerSpec(Block, DIM),
        LayerSpec(LastBlock, DIM),
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_head),
    ]


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 4, 7, 2], [3, 3, 9, 10]])


def _reference(topology: Topology) -> PipelineModule:
    return PipelineModule(_layers(), topology=topology, seed_layers=True, base_seed=7)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _two_stages(rank: int, world: int) -> dict[str, Any]:
    # The PP=1 reference (data=2 replicas: the same model on both ranks), then the PP=2 module.
    reference = _reference(Topology.build(MeshShape(data=2)))
    BUILT.clear()
    module = PipelineModule(_layers(), num_stages=2, seed_layers=True, base_seed=7)
    built = list(BUILT)
    out: dict[str, Any] = {
        "parts": module.parts,
        "stage": module.stage_id,
        "names": [n for n, _ in module.named_parameters()],
        "reference_names": [n for n, _ in reference.named_parameters()],
        "built": built,
        "tied": [
            (t.key, t.names, t.stages, t.owner, t.axis.ranks, t.axis.group is not None) for t in module.tied_weights()
        ],
        "copies": sorted(module.tied_copy_names()),
    }
    ref_state = reference.state_dict()
    out["weights_equal"] = all(torch.equal(t, ref_state[n]) for n, t in module.state_dict().items())

    # Forward and backward passed between the stages by hand.
    ids = _ids()
    expected = reference(ids)
    expected.square().mean().backward()
    if module.stage_id == 0:
        hidden = module(ids)
        dist.send(hidden.detach(), 1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, 1)
        hidden.backward(grad)
        out["logits_equal"] = None
    else:
        hidden = torch.empty(2, 4, DIM)
        dist.recv(hidden, 0)
        hidden.requires_grad_(True)
        logits = module(hidden)
        logits.square().mean().backward()
        dist.send(hidden.grad, 0)
        out["logits_equal"] = torch.allclose(logits, expected, atol=1e-6, rtol=0)
    mine, ref = _grads(module), _grads(reference)
    tied = "tied_modules.embed.weight"
    summed = mine[tied].clone()
    dist.all_reduce(summed, group=module.tied_weights()[0].axis.group)  # what ReduceTiedGrads does
    out["grads_equal"] = all(torch.allclose(g, ref[n], atol=1e-6) for n, g in mine.items() if n != tied)
    out["tied_grad_sum_equal"] = torch.allclose(summed, ref[tied], atol=1e-6)
    out["tied_grad_partial"] = not torch.allclose(mine[tied], ref[tied], atol=1e-6)

    # sync_tied_weights: the owner's value wins, logged on the engine's collectives.
    with torch.no_grad():
        module.tied_modules["embed"].weight.add_(float(module.stage_id + 1))
    collectives = Collectives(CommsLog(enabled=True))
    module.sync_tied_weights(collectives)
    owner_value = ref_state[tied] + 1.0
    out["synced"] = torch.equal(module.tied_modules["embed"].weight, owner_value)
    out["sync_ops"] = {k: (t.count, t.elements) for k, t in collectives.log.totals.items()}
    return out


def test_two_stages_names_tied_groups_and_forward(dist_run) -> None:
    results = dist_run(_two_stages, 2)
    first, last = results
    assert first["parts"] == last["parts"] == [0, 4, 8]  # parameters balanced: 66+42+42+0 = 150 | 42+42+12+66 = 162
    assert first["names"] == ["tied_modules.embed.weight", "1.fc.weight", "1.fc.bias", "2.fc.weight", "2.fc.bias"]
    assert last["names"] == [
        "tied_modules.embed.weight",
        *(f"{i}.{p}" for i in (4, 5) for p in ("fc.weight", "fc.bias")),
        "6.weight",
        "6.bias",
    ]
    assert set(first["names"]) | set(last["names"]) == set(first["reference_names"])  # stage-count independent
    assert first["built"] == ["FirstBlock", "Block"] and last["built"] == ["Block", "LastBlock"]
    tie = ("embed", ("tied_modules.embed.weight",), (0, 1), 0, (0, 1), True)
    assert first["tied"] == last["tied"] == [tie]
    assert first["copies"] == [] and last["copies"] == ["tied_modules.embed.weight"]
    assert first["weights_equal"] and last["weights_equal"]  # seeded per global layer + tied copy synced
    assert last["logits_equal"]
    assert first["grads_equal"] and last["grads_equal"]
    assert first["tied_grad_sum_equal"] and last["tied_grad_sum_equal"]
    assert first["tied_grad_partial"] and last["tied_grad_partial"]  # each copy holds only its own stage's part
    assert first["synced"] and last["synced"]
    assert first["sync_ops"] == last["sync_ops"] == {"broadcast:pipe.tied.embed": (1, VOCAB * DIM)}


def _interleaved(rank: int, world: int) -> dict[str, Any]:
    reference = _reference(Topology.build(MeshShape(data=2)))
    module = PipelineModule(
        _layers(), num_stages=2, seed_layers=True, base_seed=7, partition_method="uniform", virtual_stages=2
    )
    ids = _ids()
    expected = reference(ids)
    # Virtual stages 0..3 = (rank 0, chunk 0), (rank 1, chunk 0), (rank 0, chunk 1), (rank 1, chunk 1).
    x: torch.Tensor = ids
    for virtual in range(4):
        stage, chunk = virtual % 2, virtual // 2
        if virtual > 0 and stage == module.stage_id:
            x = torch.empty(2, 4, DIM)
            dist.recv(x, 1 - stage)
        if stage == module.stage_id:
            x = module(x, chunk=chunk)
            if virtual < 3:
                dist.send(x.detach(), 1 - stage)
    out = {
        "parts": module.parts,
        "chunks": [module.chunk_layers(c) for c in range(2)],
        "copies": sorted(module.tied_copy_names()),
        "tied_stages": [t.stages for t in module.tied_weights()],
    }
    out["equal"] = torch.allclose(x, expected, atol=1e-6, rtol=0) if module.stage_id == 1 else None
    try:
        module(ids, chunk=2)
    except ValueError as exc:
        out["chunk_error"] = str(exc)
    return out


def test_interleaved_chunks_forward(dist_run) -> None:
    first, last = dist_run(_interleaved, 2)
    assert first["parts"] == [0, 2, 4, 6, 8]
    assert first["chunks"] == [[0, 1], [4, 5]] and last["chunks"] == [[2, 3], [6, 7]]
    assert first["tied_stages"] == last["tied_stages"] == [(0, 1)]
    assert last["copies"] == ["tied_modules.embed.weight"] and first["copies"] == []
    assert last["equal"]
    assert "chunk 2 out of range" in first["chunk_error"]


def _pipe_by_data(rank: int, world: int, tensor: bool) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # forked ranks share the parent's RNG: make every rank draw its own weights
    grid = PipeModelDataParallelTopology(2, 2, 1) if tensor else PipeDataParallelTopology(num_pp=2, num_dp=2)
    module = PipelineModule(_layers(), topology=grid, seed_layers=False)
    tie = module.tied_weights()[0]
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe, group=tie.axis.group)
    weight = module.tied_modules["embed"].weight.detach().clone()
    everyone = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(everyone, weight)
    return {
        "shape": module.topology.shape,
        "stage": module.stage_id,
        "replica": (module.topology.data.rank, module.topology.tensor.rank),
        "tie_ranks": tie.axis.ranks,
        "tie_rank": tie.axis.rank,
        "probe": probe.item(),
        "equal_to": [r for r in range(world) if torch.equal(everyone[r], weight)],
    }


@pytest.mark.parametrize("tensor", [False, True], ids=["pp2xdp2", "pp2xtp2"])
def test_pipe2_by_data_or_tensor2_tie_groups(dist_run, tensor: bool) -> None:
    results = dist_run(_pipe_by_data, 4, tensor)
    shape = MeshShape(pipe=2, tensor=2) if tensor else MeshShape(pipe=2, data=2)
    assert all(r["shape"] == shape for r in results)
    replicas = [(0, 0), (0, 1)] if tensor else [(0, 0), (1, 0)]  # (data, tensor) index of ranks 0, 1 (and 2, 3)
    assert [(r["stage"], r["replica"]) for r in results] == [(s, i) for s in (0, 1) for i in replicas]
    assert [r["tie_ranks"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["tie_rank"] for r in results] == [0, 0, 1, 1]
    assert [r["probe"] for r in results] == [2.0, 4.0, 2.0, 4.0]  # the groups reduce over exactly those ranks
    # seed_layers=False: each rank drew its own weights; construction synced each tie group from its owner stage
    assert [r["equal_to"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


class Fragile(Block):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        if not self.fc.weight.is_meta:
            raise ValueError("out of memory (simulated)")


def _bad_builds(rank: int, world: int) -> list[str]:
    fragile = [*_layers()[:5], LayerSpec(Fragile, DIM), *_layers()[6:]]  # layer 5: on stage 1 only
    uneven = [*_layers(), *([LayerSpec(Block, DIM)] * rank)]  # rank 1's list is longer: another partition
    return [
        error_of(lambda: PipelineModule(fragile, num_stages=2)),
        error_of(lambda: PipelineModule(uneven, num_stages=2, partition_method="uniform")),
    ]


def test_a_failed_build_or_a_differing_partition_is_one_error_everywhere(dist_run) -> None:
    first, last = dist_run(_bad_builds, 2)
    assert first == last  # the same error on every rank, none left waiting in new_group
    assert first[0] == (
        "ValueError: pipeline stage 1 (rank 1) failed to build its layers: ValueError: out of memory (simulated)"
    )
    assert first[1].startswith("ValueError: the pipeline partition differs between ranks")
    assert "rank 0 has parts/ties ([0, 4, 8]" in first[1] and "rank 1 ([0, 5, 9]" in first[1]


def _loose_bias(rank: int, world: int) -> dict[str, Any]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("shardspeed").addHandler(Keep())
    layers = [
        TiedLayerSpec("proj", nn.Linear, DIM, DIM),
        LayerSpec(Block, DIM),
        TiedLayerSpec("proj", nn.Linear, DIM, DIM),
    ]
    module = PipelineModule(layers, num_stages=2, partition_method="uniform")
    return {"copies": sorted(module.tied_copy_names()), "names": module.tied_weights()[0].names, "warnings": records}


def test_every_parameter_of_a_tied_module_is_shared(dist_run) -> None:
    """[Note: the whole tied module is shared]: the bias is summed and synced like the tied weight (it was left to
    train apart on each stage, with a warning, while only the owner's was counted and checkpointed)."""
    first, last = dist_run(_loose_bias, 2)
    assert first["names"] == last["names"] == ("tied_modules.proj.weight", "tied_modules.proj.bias")
    assert first["copies"] == [] and last["copies"] == ["tied_modules.proj.bias", "tied_modules.proj.weight"]
    assert first["warnings"] == last["warnings"] == []
