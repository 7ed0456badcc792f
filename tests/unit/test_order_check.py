"""Collective-order verification's pure parts: fingerprints, digests, call sites, messages, the flag agreement, and
``OrderChecker`` driven by simulated peers (no processes)."""

from __future__ import annotations

import inspect

import pytest
import torch

from shardspeed.comm import Collectives
from shardspeed.comm.order_check import (
    ENV_VAR,
    CollectiveCall,
    CollectiveOrderError,
    OrderChecker,
    call_site,
    check_flags_agree,
    first_difference,
    mismatch_message,
    requested,
)
from shardspeed.topology import AxisGroup

DATA = AxisGroup("data", None, (0, 1), 0)  # the checker never touches .group: exchanges are injected


def _call(**change: object) -> CollectiveCall:
    base = dict(
        op="all_reduce(sum)",
        dtype="float32",
        shapes=((13,),),
        tag="grads",
        group="data[0, 1]",
        seq=3,
        site="shardspeed/zero/grad_sync.py:108 launch",
    )
    return CollectiveCall(**{**base, **change})  # type: ignore[arg-type]


def test_digest_is_stable_and_sensitive_to_every_fingerprinted_field() -> None:
    reference = _call()
    assert reference.digest() == _call().digest() == _call(callers="elsewhere").digest()  # callers: message only
    assert -(2**63) <= reference.digest() < 2**63
    # Not Python's salted hash(): the same fingerprint gives the same digest in any process.
    assert reference.digest() == int.from_bytes(
        __import__("hashlib").blake2b(reference.fingerprint().encode(), digest_size=8).digest(), "little", signed=True
    )
    changes = [
        {"op": "all_reduce(max)"},
        {"dtype": "bfloat16"},
        {"shapes": ((14,),)},
        {"shapes": ((13, 1),)},
        {"tag": "grad_norm"},
        {"group": "tensor[0, 1]"},
        {"group": "data[0, 2]"},
        {"seq": 4},
        {"site": "shardspeed/zero/grad_sync.py:109 launch"},
    ]
    digests = {_call(**c).digest() for c in changes}
    assert reference.digest() not in digests and len(digests) == len(changes)


def test_describe_names_op_dtype_shape_group_and_site() -> None:
    text = _call(callers="shardspeed/zero/reducer.py:90 launch").describe()
    assert text == (
        "all_reduce(sum) float32[13] tag='grads' on data[0, 1] as call #3, at shardspeed/zero/grad_sync.py:108 "
        "launch (called from shardspeed/zero/reducer.py:90 launch)"
    )
    assert (
        _call(op="all_gather_object", dtype="object", shapes=(), tag="")
        .describe()
        .startswith("all_gather_object object on data[0, 1]")
    )


def _site_here() -> tuple[str, str]:
    return call_site()


def test_call_site_is_the_first_frame_outside_comm() -> None:
    site, callers = _site_here()
    assert site.startswith("unit/test_order_check.py:") and site.endswith(" _site_here")
    assert callers.startswith("unit/test_order_check.py:")
    assert "test_call_site_is_the_first_frame_outside_comm" in callers
    # Called through Collectives (inside shardspeed/comm), the site is still this test's line: a simulated peer
    # that differs makes the checker describe this rank's call.
    collectives = Collectives()
    collectives.order = OrderChecker(lambda digest, axis: [digest, digest + 1], lambda obj, axis: [obj, "peer"])
    line = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
    with pytest.raises(CollectiveOrderError) as err:
        collectives.all_gather_object("x", DATA)
    here = f"unit/test_order_check.py:{line} test_call_site_is_the_first_frame_outside_comm"
    assert f"rank 0: all_gather_object object on data[0, 1] as call #0, at {here}" in str(err.value)


def test_first_difference() -> None:
    assert first_difference([5, 5, 5]) is None
    assert first_difference([5, 5, 6, 7]) == 2
    assert first_difference([5, 6]) == 1


def test_mismatch_message_names_both_calls_and_is_the_same_for_every_member() -> None:
    mine, theirs = _call().describe(), _call(site="tests/x.py:7 extra", seq=3).describe()
    text = mismatch_message([mine, theirs], [1, 2], (0, 1))
    assert text.startswith("collective order diverged between ranks 0 and 1")
    assert f"  rank 0: {mine}" in text and f"  rank 1: {theirs}" in text
    four = mismatch_message([mine, mine, theirs, "broadcast(src=0) float32[2] ..."], [1, 1, 2, 3], (0, 2, 4, 6))
    assert "ranks 0 and 4" in four and "2 (as rank 0)" in four and "6 (broadcast(src=0)" in four


class _Peers:
    """Simulated group members: ``theirs[i]`` is member i's next CollectiveCall description/digest source."""

    def __init__(self, other_checker_calls: list[tuple[str, tuple[torch.Tensor, ...], str]]) -> None:
        self.others = other_checker_calls
        self.index = 0
        self.last_other: CollectiveCall | None = None

    def exchange_digest(self, digest: int, axis: AxisGroup) -> list[int]:
        op, tensors, tag = self.others[self.index]
        self.index += 1
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "object"
        other = CollectiveCall(
            op, dtype, tuple(tuple(t.shape) for t in tensors), tag, "data[0, 1]", self.index - 1, "peer.py:1 f"
        )
        self.last_other = other
        return [digest, other.digest()]

    def exchange_object(self, obj: object, axis: AxisGroup) -> list[object]:
        assert self.last_other is not None
        return [obj, self.last_other.describe()]


def test_checker_raises_naming_both_calls_on_mismatch() -> None:
    peers = _Peers([("all_reduce(sum)", (torch.zeros(4),), "")])
    checker = OrderChecker(peers.exchange_digest, peers.exchange_object)
    with pytest.raises(CollectiveOrderError) as err:
        checker.check("all_reduce(sum)", DATA, (torch.zeros(4, dtype=torch.float64),), "")
    text = str(err.value)
    assert "rank 0: all_reduce(sum) float64[4] on data[0, 1] as call #0, at unit/test_order_check.py:" in text
    assert "rank 1: all_reduce(sum) float32[4] on data[0, 1] as call #0, at peer.py:1 f" in text


def test_checker_agrees_counts_sequence_per_group_and_skips_size_one_axes() -> None:
    digests: list[int] = []
    exchanged: list[str] = []

    def exchange(digest: int, axis: AxisGroup) -> list[int]:
        digests.append(digest)
        exchanged.append(axis.name)
        return [digest] * axis.size

    checker = OrderChecker(exchange, lambda obj, axis: pytest.fail("no mismatch, no description exchange"))
    t = torch.zeros(3)
    checker.check("all_reduce(sum)", DATA, (t,))
    checker.check("all_reduce(sum)", AxisGroup("tensor", None, (0, 2), 0), (t,))
    checker.check("all_reduce(sum)", DATA, (t,))
    checker.check("all_reduce(sum)", AxisGroup("pipe", None, (0,), 0), (t,))  # size 1: nothing exchanged
    assert exchanged == ["data", "tensor", "data"] and checker.checked == 3
    assert checker._seq == {("data", (0, 1)): 2, ("tensor", (0, 2)): 1}
    assert len(set(digests)) == 3


def test_off_by_default_costs_one_attribute() -> None:
    assert Collectives().order is None
    assert isinstance(Collectives(verify_order=True).order, OrderChecker)


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [(False, None, False), (True, None, True), (False, "1", True), (False, "true", True), (False, "0", False)],
)
def test_requested_by_config_or_env(flag: bool, env: str | None, expected: bool) -> None:
    environ = {} if env is None else {ENV_VAR: env}
    assert requested(flag, environ) is expected


def test_flags_must_agree() -> None:
    check_flags_agree([False, False], (0, 1))
    check_flags_agree([True, True], (0, 1))
    with pytest.raises(ValueError, match=r"on for ranks \[1\] but off for ranks \[0\].*SHARDSPEED_VERIFY_COLLECTIVES"):
        check_flags_agree([False, True], (0, 1))
