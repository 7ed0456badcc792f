"""Collective-order verification (``fault_tolerance.verify_collective_order``, or ``SHARDSPEED_VERIFY_COLLECTIVES=1``).

[Note: collective-order verification] gloo and NCCL pair collectives by call order alone: if one rank issues an
extra all-reduce, or a different dtype/shape, or picks another group, the backends either hang or silently mix
unrelated tensors. Under this debug option every collective ``Collectives`` issues is first *fingerprinted*
(op, dtype, shapes, tag, group = axis name + member ranks, the group's sequence number, and the call site = the
first frame outside ``shardspeed/comm``) and the members of its group agree on the fingerprint before the real
collective is launched: one small all-gather of a 64-bit digest over the same group (equal everywhere iff the
calls agree). Every member sees the same digests, so every member takes the same branch: on a mismatch one
``all_gather_object`` of the readable descriptions builds one message, identical on every member, naming the
reference call (the group's first member) and the first member whose call differs, with their call sites; then
each raises ``CollectiveOrderError``. The real collective is never launched, so nothing hangs or mixes.

Async collectives (bucket all-reduces, ZeRO-3 prefetch gathers) are verified at *launch*, in issue order: that is
the order the backends match them by. The agreement is itself a blocking collective, so overlap is lost while
the option is on (the cost: benchmarks/bench_order_check.py). What this does not see:
- ``comm/api.py`` (DeepSpeed's ``deepspeed.comm`` functions for scripts) and any raw ``torch.distributed`` call
  in user code: they are not verified, and one issued on one rank only pairs with a verification exchange.
- Ranks that diverge onto *different process groups* agree each on its own group; that is caught only when the
  two groups share a process group (a group spanning the whole world is checked over ``WORLD``); otherwise it
  ends at the process-group timeout (``fault_tolerance.collective_timeout_s``).
- A rank that stops issuing collectives (returned, or is computing) leaves its peers waiting in the agreement
  until it issues its next one; only then is the divergence reported.

The fingerprint, digest and message are pure functions here (unit-tested without processes); ``OrderChecker``
keeps the per-group sequence numbers and takes the two exchanges as functions, which ``comm/collectives.py``
implements with raw torch.distributed calls (unverified and unlogged, so verification never recurses).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

import torch

from shardspeed.topology import AxisGroup

ENV_VAR = "SHARDSPEED_VERIFY_COLLECTIVES"
_TRUE = frozenset({"1", "true", "yes", "on"})
_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(_COMM_DIR))  # .../src (or site-packages)
CONTEXT_FRAMES = 4  # callers shown after the call site in messages (not fingerprinted)


class CollectiveOrderError(RuntimeError):
    """Ranks of one group were about to issue different collectives (diverging control flow). Raised on every
    member of that group with the same message."""


def requested(config_flag: bool, environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """The option is on when the config says so or ``SHARDSPEED_VERIFY_COLLECTIVES`` is 1/true/yes/on."""
    return config_flag or environ.get(ENV_VAR, "").strip().lower() in _TRUE


def check_flags_agree(flags: Sequence[object], ranks: Sequence[int]) -> None:
    """Every rank must verify or none (a verifying rank's extra exchanges would pair with a peer's real
    collectives). ``flags`` is the all-gathered ``requested(...)`` of ``ranks``; raise naming both sides."""
    on = [r for r, f in zip(ranks, flags) if f]
    if on and len(on) != len(ranks):
        off = [r for r, f in zip(ranks, flags) if not f]
        raise ValueError(
            f"collective-order verification is on for ranks {on} but off for ranks {off}: set "
            f"fault_tolerance.verify_collective_order or {ENV_VAR}=1 for every rank alike"
        )


def _short_path(filename: str) -> str:
    """Library files relative to the package parent (``shardspeed/zero/reducer.py``), others as their last two
    components: node-independent, so ranks installed under different prefixes still agree."""
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE_PARENT + os.sep) and os.sep + "shardspeed" + os.sep in path:
        return os.path.relpath(path, _PACKAGE_PARENT)
    parent, name = os.path.split(path)
    return os.path.join(os.path.basename(parent), name) if parent else name


def _frame_text(frame: FrameType) -> str:
    return f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"


def site_frame(frame: FrameType | None = None) -> FrameType | None:
    """The first frame outside ``shardspeed/comm`` (from ``frame``, default: the caller's)."""
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_DIR:
        frame = frame.f_back
    return frame


def call_site(frame: FrameType | None = None, context: int = CONTEXT_FRAMES) -> tuple[str, str]:
    """(call site, callers): the first frame outside ``shardspeed/comm`` as ``file:line function``, and up to
    ``context`` frames above it (for messages only: they are not fingerprinted)."""
    site = site_frame(frame if frame is not None else sys._getframe(1))
    if site is None:
        return "<unknown>", ""
    callers: list[str] = []
    above = site.f_back
    while above is not None and len(callers) < context:
        callers.append(_frame_text(above))
        above = above.f_back
    return _frame_text(site), " <- ".join(callers)


def group_label(axis: AxisGroup) -> str:
    return f"{axis.name}{list(axis.ranks)}"


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as a rank was about to issue it. Everything but ``callers`` is fingerprinted."""

    op: str  # "all_reduce(sum)", "all_gather", "broadcast(src=0)", "all_gather_object", ...
    dtype: str  # "float32", or "object"
    shapes: tuple[tuple[int, ...], ...]
    tag: str
    group: str  # axis name + member ranks
    seq: int  # this group's call number on this rank (0-based)
    site: str  # first frame outside shardspeed/comm: "file:line function"
    callers: str = ""

    def fingerprint(self) -> str:
        shapes = ",".join("x".join(map(str, s)) or "scalar" for s in self.shapes)
        return f"{self.op}|{self.dtype}|{shapes}|{self.tag}|{self.group}|{self.seq}|{self.site}"

    def digest(self) -> int:
        """A stable signed 64-bit digest (Python's ``hash`` of str is salted per process: ranks would differ)."""
        raw = hashlib.blake2b(self.fingerprint().encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little", signed=True)

    def describe(self) -> str:
        shapes = ", ".join(f"[{', '.join(map(str, s))}]" for s in self.shapes)
        tensor = f"{self.dtype}{shapes}" if self.shapes else self.dtype
        tag = f" tag={self.tag!r}" if self.tag else ""
        callers = f" (called from {self.callers})" if self.callers else ""
        return f"{self.op} {tensor}{tag} on {self.group} as call #{self.seq}, at {self.site}{callers}"


def describe_tensors(tensors: Sequence[torch.Tensor]) -> tuple[str, tuple[tuple[int, ...], ...]]:
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "object"
    return dtype, tuple(tuple(t.shape) for t in tensors)


def first_difference(digests: Sequence[int]) -> int | None:
    """Index of the first member whose digest differs from member 0's, or None when all agree."""
    for index, digest in enumerate(digests):
        if digest != digests[0]:
            return index
    return None


def mismatch_message(descriptions: Sequence[str], digests: Sequence[int], ranks: Sequence[int]) -> str:
    """The same text on every member: the reference call (member 0) against the first that differs, plus which
    other members sided with which."""
    other = first_difference(digests)
    assert other is not None, "mismatch_message needs a mismatch"
    lines = [
        f"collective order diverged between ranks {ranks[0]} and {ranks[other]} (different control flow on "
        f"different ranks; launching would hang or mix tensors):",
        f"  rank {ranks[0]}: {descriptions[0]}",
        f"  rank {ranks[other]}: {descriptions[other]}",
    ]
    rest = [i for i in range(len(ranks)) if i not in (0, other)]
    if rest:
        sides = ", ".join(
            f"{ranks[i]} (as rank {ranks[0] if digests[i] == digests[0] else ranks[other]})"
            if digests[i] in (digests[0], digests[other])
            else f"{ranks[i]} ({descriptions[i]})"
            for i in rest
        )
        lines.append(f"  other ranks: {sides}")
    return "\n".join(lines)


ExchangeDigest = Callable[[int, AxisGroup], list[int]]
ExchangeObject = Callable[[object, AxisGroup], list[object]]


class OrderChecker:
    """Per-``Collectives`` verification state: sequence numbers per group. ``exchange_digest`` all-gathers one
    int over the group's members; ``exchange_object`` all-gathers a picklable object (both unverified)."""

    def __init__(self, exchange_digest: ExchangeDigest, exchange_object: ExchangeObject) -> None:
        self._exchange_digest = exchange_digest
        self._exchange_object = exchange_object
        self._seq: dict[tuple[str, tuple[int, ...]], int] = {}
        self.checked = 0  # collectives agreed so far (tests, benchmark)

    def check(self, op: str, axis: AxisGroup, tensors: Sequence[torch.Tensor] = (), tag: str = "") -> None:
        """Agree on this collective with the other members of ``axis`` before it is launched; raise
        ``CollectiveOrderError`` on every member if any member is about to issue a different one."""
        if axis.size == 1:
            return  # a no-op on a size-1 axis: nothing to pair
        key = (axis.name, axis.ranks)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        dtype, shapes = describe_tensors(tensors)
        frame = site_frame(sys._getframe(1))
        site = "<unknown>" if frame is None else _frame_text(frame)
        call = CollectiveCall(op, dtype, shapes, tag, group_label(axis), seq, site)
        digests = self._exchange_digest(call.digest(), axis)
        if first_difference(digests) is None:
            self.checked += 1
            return
        # Only now the callers above the site (for the message; the hot path walks no further than the site).
        call = dataclasses.replace(call, callers=call_site(frame)[1]) if frame is not None else call
        descriptions = [str(d) for d in self._exchange_object(call.describe(), axis)]
        raise CollectiveOrderError(mismatch_message(descriptions, digests, axis.ranks))
