"""Review A #8: ``Collectives.all_to_all_single`` refuses bad arguments with a ValueError before any collective,
order-check exchange, comms-log record or simulated-link hold ([Note: symmetric argument checks])."""

from __future__ import annotations

import pytest
import torch

from shardspeed.comm import Collectives, CommsLog
from shardspeed.comm.arg_checks import overlaps
from shardspeed.comm.simulated_link import SimulatedLink
from shardspeed.topology import AxisGroup

PAIR = AxisGroup("data", None, (0, 1), 0)  # never reached: every case raises before the process group is used


def _collectives() -> Collectives:
    return Collectives(CommsLog(enabled=True), link=SimulatedLink(1.0))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.empty(6), torch.empty(8)), "equal sizes"),
        (lambda: (torch.empty(7), torch.empty(7)), "divisible"),
        (lambda: (torch.empty(4, dtype=torch.uint8), torch.empty(4)), "must match"),
        (lambda: (torch.empty(4, 2).t(), torch.empty(8)), "contiguous"),
    ],
)
def test_bad_arguments_raise_before_anything_is_recorded(make, match) -> None:  # type: ignore[no-untyped-def]
    c = _collectives()
    output, tensor = make()
    with pytest.raises(ValueError, match=match):
        c.all_to_all_single(output, tensor, PAIR)
    assert not c.log.totals and c.link is not None and c.link.busy_until == float("-inf")


def test_aliasing_is_refused() -> None:
    c = _collectives()
    buf = torch.zeros(16)
    for output, tensor in [(buf, buf), (buf[:8], buf[4:12]), (buf.view(2, 8), buf)]:
        with pytest.raises(ValueError, match="aliases"):
            c.all_to_all_single(output, tensor, PAIR)
    assert not c.log.totals
    alone = AxisGroup("data", None, (0,), 0)
    with pytest.raises(ValueError, match="aliases"):  # the same rule at every axis size
        c.all_to_all_single(buf, buf, alone)


def test_overlaps() -> None:
    buf = torch.zeros(16)
    assert overlaps(buf[:8], buf[7:9]) and not overlaps(buf[:8], buf[8:])
    assert not overlaps(buf, torch.zeros(16)) and not overlaps(buf[:0], buf)
    assert overlaps(buf.view(4, 4)[:, 0], buf[5:6]) and not overlaps(buf[:4], buf[::4][1:])  # strided over-estimate


def test_size_one_axis_copies() -> None:
    out, src = torch.empty(2, 3), torch.arange(6.0)
    Collectives(CommsLog()).all_to_all_single(out, src, AxisGroup("data", None, (0,), 0))
    assert torch.equal(out.view(-1), src)
