"""``SHARDSPEED_INJECT``: the grammar (pure parsing), clear errors naming a malformed spec, and ``maybe_fail``'s
counting (``after``, ``times``, ``rank``)."""

from __future__ import annotations

import errno

import pytest

from shardspeed.faults.inject import ENV_VAR, InjectionSpec, maybe_fail, parse_plan, parse_spec


def test_full_spec_parses() -> None:
    spec = parse_spec("checkpoint_write:enospc:rank=1:after=2")
    assert spec == InjectionSpec("checkpoint_write", "enospc", 1, 2, None, "checkpoint_write:enospc:rank=1:after=2")
    assert [spec.fires_at(n) for n in (1, 2, 3, 4)] == [False, False, True, True]  # the disk stays full


def test_defaults_and_times() -> None:
    assert parse_spec("offload_setup:enospc") == InjectionSpec("offload_setup", "enospc", text="offload_setup:enospc")
    once = parse_spec("offload_write:eio:after=5:times=1")
    assert [once.fires_at(n) for n in (5, 6, 7)] == [False, True, False]


def test_plan_of_several_specs() -> None:
    plan = parse_plan(" offload_write:enospc:after=5 ; checkpoint_write:kill:rank=0;")
    assert [(s.point, s.kind, s.rank, s.after) for s in plan] == [
        ("offload_write", "enospc", None, 5),
        ("checkpoint_write", "kill", 0, 0),
    ]
    assert parse_plan("") == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("checkpoint_write", "must look like point:kind"),
        ("disk_write:enospc", "unknown point 'disk_write'; valid: checkpoint_write, offload_write, offload_setup"),
        ("checkpoint_write:full", "unknown kind 'full'; valid: enospc, eio, kill"),
        ("checkpoint_write:enospc:rank", "option 'rank' must be key=value"),
        ("checkpoint_write:enospc:ranks=1", "option 'ranks=1' must be key=value with key one of rank, after, times"),
        ("checkpoint_write:enospc:after=-1", "after='-1' must be an integer >= 0"),
        ("checkpoint_write:enospc:after=x", "after='x' must be an integer >= 0"),
        ("checkpoint_write:enospc:times=0", "times='0' must be an integer >= 1"),
        ("checkpoint_write:enospc:rank=1:rank=2", "rank is given twice"),
    ],
)
def test_malformed_spec_is_named(text: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_plan(f"offload_setup:enospc;{text}")
    assert f"{ENV_VAR} spec {text!r}" in str(info.value)
    assert expected in str(info.value)


def test_maybe_fail_counts_calls_per_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(ENV_VAR, "checkpoint_write:enospc:rank=1:after=2:times=1;offload_write:eio:rank=0")
    maybe_fail("checkpoint_write")
    maybe_fail("checkpoint_write")
    maybe_fail("offload_write")  # rank 0 only
    with pytest.raises(OSError) as info:
        maybe_fail("checkpoint_write", "/ckpt/rank00001-000.safetensors")
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == "/ckpt/rank00001-000.safetensors"
    assert "injected by SHARDSPEED_INJECT='checkpoint_write:enospc:rank=1:after=2:times=1'" in str(info.value)
    maybe_fail("checkpoint_write")  # times=1: the 4th call succeeds again
    monkeypatch.setenv(ENV_VAR, "checkpoint_write:enospc")  # a new value is a new plan, counted from zero
    with pytest.raises(OSError):
        maybe_fail("checkpoint_write")
    monkeypatch.delenv(ENV_VAR)
    maybe_fail("checkpoint_write")
