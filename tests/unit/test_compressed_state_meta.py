"""Review A #2: compressed collectives' error buffers name the [numel, axis size] they were saved at, and a load
into another refuses clearly — even where the buffer shapes coincide (a reduce-scatter at numel 2^20 or 20,
world 2 vs 4). The engine's checkpoint path resets instead at another world size (tests/dist/
test_onebit_adam_engine.py, tests/dist/test_zero_compressed.py); this is the guard under it."""

from __future__ import annotations

import pytest
import torch

from shardspeed.comm import Collectives, CommsLog
from shardspeed.compression import CompressedAllReduce, CompressedReduceScatter
from shardspeed.topology import AxisGroup

CPU = torch.device("cpu")


def _axis(world: int) -> AxisGroup:
    return AxisGroup("data", None, tuple(range(world)), 0)  # no communication happens here


def _make(kind: type, numel: int, world: int) -> CompressedAllReduce | CompressedReduceScatter:
    return kind(numel, _axis(world), Collectives(CommsLog()), device=CPU)


@pytest.mark.parametrize("kind", [CompressedAllReduce, CompressedReduceScatter])
@pytest.mark.parametrize("numel", [20 * 4, 1 << 20])
def test_load_at_another_axis_size_is_refused(kind: type, numel: int) -> None:
    saved = _make(kind, numel, 2)
    saved.worker_error.fill_(1.0)
    sd = saved.state_dict()
    assert sd["meta"].tolist() == [numel, 2]
    with pytest.raises(ValueError, match=r"saved for \[numel, axis size\] = \[\d+, 2\].*reset\(\)"):
        _make(kind, numel, 4).load_state_dict(sd)
    same = _make(kind, numel, 2)
    same.load_state_dict(sd)  # the same size and axis size: restored
    assert torch.equal(same.worker_error, saved.worker_error)


def test_reduce_scatter_shapes_coincide_but_layouts_differ() -> None:
    """numel 20: world 2 is 2×[10 + 6 pad], world 4 is 4×[5 + 3] — both 32 elements; meta tells them apart."""
    two, four = _make(CompressedReduceScatter, 20, 2), _make(CompressedReduceScatter, 20, 4)
    assert two.worker_error.shape == four.worker_error.shape
    with pytest.raises(ValueError, match="another size or axis size"):
        four.load_state_dict(two.state_dict())


def test_another_numel_and_missing_meta_are_refused() -> None:
    sd = _make(CompressedAllReduce, 1 << 10, 2).state_dict()
    with pytest.raises(ValueError, match="saved for"):
        _make(CompressedAllReduce, 1 << 11, 2).load_state_dict(sd)
    del sd["meta"]
    with pytest.raises(ValueError, match="state keys"):
        _make(CompressedAllReduce, 1 << 10, 2).load_state_dict(sd)
