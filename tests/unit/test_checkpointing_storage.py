"""How checkpointed inputs are stored: as is, in host memory, or as this rank's slice (no process group needed
to store; the all-gather that rebuilds a slice is covered by the dist tests)."""

from __future__ import annotations

import pytest
import torch

from shardspeed.checkpointing.partition import InputStore, StoragePlan
from shardspeed.comm.collectives import Collectives
from shardspeed.topology import AxisGroup


def axis(size: int, rank: int = 0) -> AxisGroup:
    return AxisGroup("tensor", None, tuple(range(size)), rank)


@pytest.mark.parametrize(("numel", "size"), [(12, 2), (13, 2), (10, 3), (4, 4)])
def test_slices_cover_the_flat_tensor_once(numel: int, size: int) -> None:
    x = torch.arange(float(numel)).reshape(-1, 1) if numel % 2 else torch.arange(float(numel)).reshape(2, -1)
    slices = []
    for rank in range(size):
        (stored,) = InputStore((x,), {}, StoragePlan(partition=True), axis(size, rank)).stored_tensors
        assert stored.partitioned and stored.data.numel() == -(-numel // size)  # equal, padded slices
        assert stored.data.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # x can be freed
        slices.append(stored.data)
    whole = torch.cat(slices)
    assert torch.equal(whole[:numel], x.reshape(-1)) and not whole[numel:].any()


def test_what_is_not_partitioned() -> None:
    ids = torch.arange(6)  # integer: kept whole
    tiny = torch.ones(1)  # fewer elements than ranks
    weight = torch.nn.Parameter(torch.ones(4))  # owned by the module: kept by reference
    store = InputStore((ids, tiny, weight, "text", 3), {"x": torch.ones(8)}, StoragePlan(partition=True), axis(2))
    stored = store.stored_tensors
    assert [s.partitioned for s in stored] == [False, False, True]
    assert store.nbytes == ids.numel() * 8 + 4 + 4 * 4
    unpartitioned = InputStore((ids, tiny, weight, "text", 3), {}, StoragePlan(partition=True), axis(2))
    args, _ = unpartitioned.rebuild(Collectives(), axis(2))  # nothing to gather: no process group needed
    assert args[2] is weight and args[3:] == ("text", 3)
    assert torch.equal(args[0], ids) and torch.equal(args[1], tiny)


def test_one_rank_axis_and_cpu_checkpointing_on_cpu_store_the_input_itself() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    for plan in (StoragePlan(), StoragePlan(cpu=True), StoragePlan(partition=True), StoragePlan(True, True)):
        store = InputStore((x,), {}, plan, axis(1))
        (stored,) = store.stored_tensors
        assert stored.data.data_ptr() == x.data_ptr() and stored.data.grad_fn is None  # no copy, no graph
        ((rebuilt,), _) = store.rebuild(Collectives(), axis(1))
        assert torch.equal(rebuilt, x) and rebuilt.requires_grad and rebuilt.is_leaf


def test_contiguous_packs_one_checkpoints_slices_into_one_buffer() -> None:
    a, b, c = torch.randn(10), torch.randn(3, 3), torch.randn(6, dtype=torch.float64)
    plan = StoragePlan(partition=True, contiguous=True)
    sa, sb, sc = InputStore((a, b), {"c": c}, plan, axis(2, 1)).stored_tensors
    assert sa.data.untyped_storage().data_ptr() == sb.data.untyped_storage().data_ptr()  # float32 slices share
    assert sc.data.untyped_storage().data_ptr() != sa.data.untyped_storage().data_ptr()  # float64: its own
    assert torch.equal(sa.data, a[5:]) and torch.equal(sb.data, torch.cat([b.reshape(-1)[5:], torch.zeros(1)]))
    assert torch.equal(sc.data, c[3:])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_checkpointing_moves_cuda_inputs_to_host_and_back() -> None:
    x = torch.randn(4, 4, device="cuda", requires_grad=True)
    store = InputStore((x,), {}, StoragePlan(cpu=True), axis(1))
    assert store.stored_tensors[0].data.device.type == "cpu"
    ((rebuilt,), _) = store.rebuild(Collectives(), axis(1))
    assert rebuilt.device == x.device and torch.equal(rebuilt, x) and rebuilt.requires_grad
