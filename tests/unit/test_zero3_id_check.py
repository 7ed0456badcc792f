"""The ZeRO-3 unit-id check never blocks the training thread on CPU (issue #16: the MLP spent 34 ms per step
waiting for tiny id gathers queued behind other units' data on gloo's worker threads), yet still reads every check:
finished ones right after the next unit's wait, the rest at the step boundary."""

from __future__ import annotations

import pytest
import torch

from shardspeed.topology import AxisGroup
from shardspeed.zero.stage3.id_check import UnitIdCheck, UnitMismatchError


class _Pending:
    """A work handle that finishes only when the test says so; ``wait()`` finishes it (as a real wait would)."""

    def __init__(self, ids: torch.Tensor, gathered: list[int]) -> None:
        self.ids, self.gathered, self.finished, self.waited = ids, gathered, False, False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waited = True
        self.finish()

    def finish(self) -> None:
        self.ids.copy_(torch.tensor(self.gathered))
        self.finished = True


class _Collectives:
    """All-gathers the launching rank's id with what the other rank reached (scripted)."""

    def __init__(self, other_rank_units: list[int]) -> None:
        self.other = list(other_rank_units)
        self.works: list[_Pending] = []

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, axis: AxisGroup, **_: object) -> _Pending:
        work = _Pending(out, [int(mine[0]), self.other.pop(0)])
        self.works.append(work)
        return work


def _check(other_rank_units: list[int]) -> tuple[UnitIdCheck, _Collectives]:
    collectives = _Collectives(other_rank_units)
    axis = AxisGroup("data", None, (0, 1), 0)
    return UnitIdCheck(axis, collectives, ["a", "b", "c"], immediate=True), collectives  # type: ignore[arg-type]


def test_an_unfinished_check_is_not_waited_for_after_a_unit_wait() -> None:
    check, collectives = _check([0, 1])
    check.launch(0, "gather", torch.device("cpu"))
    check.launch(1, "gather", torch.device("cpu"))
    collectives.works[0].finish()
    check.after_wait()  # reads the finished first check; the second is still in flight
    assert not collectives.works[1].waited  # (waiting a finished handle returns at once)
    assert len(check._pending) == 1
    check.verify()  # the step boundary reads the rest
    assert collectives.works[1].waited and not check._pending


def test_a_mismatch_in_a_finished_check_raises_at_the_next_unit_wait() -> None:
    check, collectives = _check([0, 2])
    check.launch(0, "gather", torch.device("cpu"))
    check.launch(1, "gather", torch.device("cpu"))
    for work in collectives.works:
        work.finish()
    expected = "this rank reached unit 'b' while data-parallel rank 1 reached unit 'c'"
    with pytest.raises(UnitMismatchError, match=expected):
        check.after_wait()


def test_checks_are_read_in_order_so_the_first_divergence_is_the_one_reported() -> None:
    check, collectives = _check([1, 0])
    check.launch(0, "gather", torch.device("cpu"))
    check.launch(1, "gather", torch.device("cpu"))
    collectives.works[1].finish()  # the second finished first: nothing is read past an unfinished check
    check.after_wait()
    assert len(check._pending) == 2
    expected = "this rank reached unit 'a' while data-parallel rank 1 reached unit 'b'"
    with pytest.raises(UnitMismatchError, match=expected):
        check.verify()
