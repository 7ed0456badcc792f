"""``PartwiseCompressedAllReduce`` ([Note: partwise compressed all-reduce]) against one ``CompressedAllReduce`` per
part on the same gloo ranks: the same results and error buffers bit for bit over several steps (sizes that need
padding, a 1-element part, a part larger than one sweep block, bf16 and non-contiguous parts), in 4 collectives
per call instead of 4 per part and the same bytes; its state's ``meta`` refuses another split of the same total."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from shardspeed.comm import Collectives, CommsLog
from shardspeed.compression.collective import CompressedAllReduce
from shardspeed.compression.partwise import PartwiseCompressedAllReduce
from shardspeed.compression.signs import BLOCK
from shardspeed.topology import AxisGroup

CPU = torch.device("cpu")
SIZES = [30, 1, 1003, BLOCK + 77, 8]


def _run(rank: int, world: int, steps: int) -> dict[str, Any]:
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    log_one, log_all = CommsLog(enabled=True), CommsLog(enabled=True)
    partwise = PartwiseCompressedAllReduce(SIZES, axis, Collectives(log_all, verify_order=True), device=CPU)
    singles = [CompressedAllReduce(n, axis, Collectives(log_one), device=CPU) for n in SIZES]
    mismatches = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        xs = [torch.randn(n, generator=gen) * (10.0 ** (j - 2)) for j, n in enumerate(SIZES)]  # scales far apart
        ours = [x.clone() for x in xs]
        ours[0] = torch.stack([xs[0], xs[0]], 1)[:, 0]  # not contiguous (stride 2): received through a copy
        work = partwise.launch(ours)
        assert not work.done()
        work.wait()
        for j, (x, single) in enumerate(zip(xs, singles)):
            single(x)
            if not torch.equal(ours[j], x):
                mismatches.append((step, j))
    errors = {"worker": [], "server": []}
    for single in singles:
        errors["worker"].append(single.worker_error)
        errors["server"].append(single.server_error)
    sd = partwise.state_dict()
    same_errors = torch.equal(sd["worker_error"], torch.cat(errors["worker"])) and torch.equal(
        sd["server_error"], torch.cat(errors["server"])
    )
    calls = {k: r["count"] for k, r in log_all.rows().items()}
    bytes_all = sum(t.algorithmic_bytes for t in log_all.totals.values())
    bytes_one = sum(t.algorithmic_bytes for t in log_one.totals.values())
    refused = ""
    other = PartwiseCompressedAllReduce(
        [SIZES[0] + 1, *SIZES[1:-1], SIZES[-1] - 1], axis, Collectives(log_one), device=CPU
    )
    try:
        other.load_state_dict(sd)
    except ValueError as error:
        refused = str(error)
    bf16 = [torch.ones(n, dtype=torch.bfloat16) * (rank + 1) for n in SIZES]
    partwise.reset()
    partwise.launch(bf16).wait()
    return {
        "mismatches": mismatches,
        "same_errors": same_errors,
        "calls": calls,
        "bytes": (bytes_all, bytes_one),
        "refused": refused,
        "bf16_dtype": {t.dtype for t in bf16},
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_partwise_equals_one_compressed_allreduce_per_part(tmp_path: Any, world: int) -> None:
    steps = 3
    for result in run_ranks(_run, world, tmp_path, steps):
        assert result["mismatches"] == [] and result["same_errors"], result
        # 2 per call, whatever the parts: the scales ride in the sign rows
        assert result["calls"] == {"all_to_all:compressed": steps, "all_gather:compressed": steps}, result["calls"]
        bytes_all, bytes_one = result["bytes"]
        assert bytes_all == bytes_one, result["bytes"]  # the same bytes as the per-part calls
        assert "[numel, axis size, *part sizes]" in result["refused"], result["refused"]
        assert result["bf16_dtype"] == {torch.bfloat16}


def test_partwise_refuses_parts_of_other_sizes() -> None:
    axis = AxisGroup("data", None, (0,), 0)
    op = PartwiseCompressedAllReduce([3, 4], axis, Collectives(CommsLog(enabled=False)), device=CPU)
    with pytest.raises(ValueError, match=r"parts of \[4, 3\] elements, expected floating tensors of \[3, 4\]"):
        op.launch([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="sizes must be positive"):
        PartwiseCompressedAllReduce([3, 0], axis, Collectives(CommsLog(enabled=False)), device=CPU)
