"""[Note: compressed all-reduce] over gloo at 2 and 4 ranks: equal to the one-process reference, the same result
on every rank, exact on a size-1 axis, and the traffic figures the comms log counts (≤ 1.1/32 of fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from shardspeed.comm import Collectives, CommsLog
from shardspeed.compression import CompressedAllReduce, CompressedReduceScatter, reference
from shardspeed.compression.signs import padded_numel
from shardspeed.topology import AxisGroup

CPU = torch.device("cpu")


def _axis(rank: int, world: int) -> AxisGroup:
    return AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)


def _inputs(step: int, world: int, numel: int) -> list[torch.Tensor]:
    """Every rank's input at ``step`` (all ranks build all of them: the reference needs them)."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + r)) + 0.5 for r in range(world)]


def _allreduce(rank: int, world: int, numel: int, steps: int) -> dict[str, Any]:
    c = Collectives(CommsLog(enabled=True), verify_order=True)
    op = CompressedAllReduce(numel, _axis(rank, world), c, device=CPU)
    parts_op = CompressedAllReduce(numel, _axis(rank, world), c, device=CPU)  # the same bucket given in pieces
    padded = padded_numel(numel, world)
    we = [torch.zeros(padded) for _ in range(world)]
    se = [torch.zeros(padded // world) for _ in range(world)]
    results, diffs = [], []
    for step in range(steps):
        xs = _inputs(step, world, numel)
        mine = xs[rank].clone()
        work = op.launch(mine) if step % 2 else None  # the async form on odd steps
        if work is None:
            op(mine)
        else:
            assert not work.done()
            work.wait()
            assert work.done()
        expected = reference.compressed_allreduce(xs, we, se)
        pieces = [p.clone().view(1, -1) for p in xs[rank].split([numel // 3, 1, numel - numel // 3 - 1])]
        parts_op.launch_parts(pieces).wait()
        assert torch.equal(torch.cat(pieces, 1).view(-1), expected)  # the same bits, in place in each piece
        diffs.append((mine - expected).abs().max().item())
        results.append(mine)
    sd = op.state_dict()
    assert torch.equal(sd["worker_error"], we[rank]) and torch.equal(sd["server_error"], se[rank])
    return {"max_diff": max(diffs), "results": results, "order_checked": c.order.checked if c.order else 0}


@pytest.mark.parametrize("world,numel", [(2, 1003), (4, 4096 + 5)])
def test_compressed_allreduce_equals_reference_and_agrees(tmp_path: Any, world: int, numel: int) -> None:
    out = run_ranks(_allreduce, world, tmp_path, numel, 4)
    assert max(o["max_diff"] for o in out) == 0.0  # bit for bit
    for o in out[1:]:  # every rank holds the identical result
        assert all(torch.equal(a, b) for a, b in zip(o["results"], out[0]["results"], strict=True))
    assert out[0]["order_checked"] > 0


def _reduce_scatter(rank: int, world: int, numel: int, steps: int) -> float:
    c = Collectives(CommsLog(enabled=True))
    op = CompressedReduceScatter(numel, _axis(rank, world), c, device=CPU)
    chunk = -(-(numel // world) // 8) * 8
    we = [torch.zeros(world * chunk) for _ in range(world)]
    worst = 0.0
    for step in range(steps):
        xs = _inputs(step, world, numel)
        shard = torch.empty(numel // world)
        if step % 2:  # the async form on odd steps (review A #10): done() only after wait()
            work = op.launch(shard, xs[rank].clone())
            assert not work.done()
            work.wait()
            assert work.done()
        else:
            op(shard, xs[rank].clone())
        expected = reference.compressed_reduce_scatter(xs, we)[rank]
        worst = max(worst, (shard - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_reduce_scatter_equals_reference(tmp_path: Any, world: int) -> None:
    assert max(run_ranks(_reduce_scatter, world, tmp_path, 4 * 251, 3)) == 0.0  # bit for bit


def _size_one_axis(rank: int, world: int) -> dict[str, Any]:
    """A size-1 axis (each rank alone): exact, no communication, no error buffers."""
    c = Collectives(CommsLog(enabled=True))
    alone = AxisGroup("data", None, (rank,), 0)
    x = torch.randn(1001)
    y = x.clone()
    ar = CompressedAllReduce(1001, alone, c, device=CPU)
    ar(y)
    rs = CompressedReduceScatter(1001, alone, c, device=CPU)
    shard = torch.empty(1001)
    rs(shard, x)
    return {"exact": torch.equal(y, x) and torch.equal(shard, x), "calls": len(c.log.totals), "bytes": ar.error_bytes}


def test_size_one_axis_is_exact(tmp_path: Any) -> None:
    assert run_ranks(_size_one_axis, 2, tmp_path) == [{"exact": True, "calls": 0, "bytes": 0}] * 2


def _traffic(rank: int, world: int, numel: int) -> dict[str, float]:
    c = Collectives(CommsLog(enabled=True))
    axis = _axis(rank, world)
    x = torch.randn(numel)
    CompressedAllReduce(numel, axis, c, device=CPU, tag="ar")(x)
    CompressedReduceScatter(numel, axis, c, device=CPU, tag="rs")(torch.empty(numel // world), x)
    c.all_reduce(x, axis, tag="fp32")
    c.reduce_scatter(torch.empty(numel // world), x, axis, tag="fp32rs")
    log = c.log
    return {
        "ar": log.algorithmic_bytes(tag="ar") / log.algorithmic_bytes("all_reduce", tag="fp32"),
        "rs": log.algorithmic_bytes(tag="rs") / log.algorithmic_bytes("reduce_scatter", tag="fp32rs"),
        "fp32_ar": log.algorithmic_bytes("all_reduce", tag="fp32") / (2 * (world - 1) / world * 4 * numel),
    }


def test_traffic_is_one_thirty_second_of_fp32_at_any_world_size(tmp_path: Any) -> None:
    numel = 1 << 20
    ratios = {world: run_ranks(_traffic, world, tmp_path, numel)[0] for world in (2, 4)}
    for world, r in ratios.items():
        print(
            f"world {world}: compressed/fp32 all-reduce {r['ar']:.6f} ({r['ar'] * 32:.5f}/32), "
            f"reduce-scatter {r['rs']:.6f} ({r['rs'] * 32:.5f}/32)"
        )
        assert r["fp32_ar"] == pytest.approx(1.0)
        assert r["ar"] <= 1.1 / 32 and r["rs"] <= 1.1 / 32
        # exact (README): packed signs n/8 + N fp32 scales per phase, against fp32's 4n; no padding at 2^20
        assert r["ar"] == pytest.approx(1 / 32 + world / numel, rel=1e-12)
        assert r["rs"] == pytest.approx(1 / 32 + world / numel, rel=1e-12)
    for op in ("ar", "rs"):
        assert abs(ratios[4][op] / ratios[2][op] - 1) <= 0.05


def _all_to_all(rank: int, world: int) -> dict[str, Any]:
    c = Collectives(CommsLog(enabled=True), verify_order=True)
    axis = _axis(rank, world)
    src = torch.tensor([[10 * rank + j] * 3 for j in range(world)], dtype=torch.uint8)  # block j goes to member j
    out = torch.empty_like(src)
    c.all_to_all_single(out, src, axis, tag="t")
    work = c.all_to_all_single(out2 := torch.empty_like(src), src, axis, async_op=True, tag="t")
    work.wait()
    try:
        c.all_to_all_single(torch.empty(world + 1), torch.empty(world + 1), axis)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    totals = c.log.totals["all_to_all:t"]
    return {
        "out": out.tolist(),
        "same": torch.equal(out, out2),
        "error": error,
        "bytes": totals.algorithmic_bytes,
        "count": totals.count,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_single_routes_blocks_and_is_logged(tmp_path: Any, world: int) -> None:
    for rank, r in enumerate(run_ranks(_all_to_all, world, tmp_path)):
        assert r["out"] == [[10 * i + rank] * 3 for i in range(world)]  # block i came from member i
        assert r["same"] and r["count"] == 2
        assert r["bytes"] == pytest.approx(2 * (world - 1) / world * 3 * world)  # (N−1)/N of the message, twice
        assert "divisible by the data axis" in r["error"]
