"""Fault injection for tests and the fault table: ``SHARDSPEED_INJECT`` makes chosen write calls fail.

Grammar: one or more specs separated by ``;``, each ``point:kind[:key=value...]``::

    SHARDSPEED_INJECT="checkpoint_write:enospc:rank=1:after=2"   # rank 1's 3rd checkpoint write raises ENOSPC
    SHARDSPEED_INJECT="offload_write:enospc:after=5;offload_setup:eio:rank=0"

Points (each write layer calls ``maybe_fail(point)`` once per operation):

- ``checkpoint_write``: every write of checkpoint bytes — each tensor chunk of a rank's safetensors files, and
  ``index.json``, ``metadata.json`` and ``latest`` (checkpoint/store.py, checkpoint/commit.py);
- ``offload_write``: each block written to an NVMe swap file (offload/swapper.py, on its I/O threads);
- ``offload_setup``: creating (preallocating) a swap file (offload/swap_file.py).

Kinds: ``enospc`` (``OSError(ENOSPC)``: a full disk), ``eio`` (``OSError(EIO)``: a failing disk), ``kill``
(``SIGKILL`` of the calling process: a rank dying mid-write). Keys: ``rank=N`` (only on global rank N; default
every rank), ``after=N`` (the first N matching calls succeed; default 0), ``times=N`` (fail N calls, then succeed
again; default: every later call fails, as a disk that stays full does).

Parsing is pure (``parse_plan``); a malformed spec is a ``ValueError`` naming the spec and what is wrong.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from dataclasses import dataclass, field

ENV_VAR = "SHARDSPEED_INJECT"
POINTS = ("checkpoint_write", "offload_write", "offload_setup")
KINDS = ("enospc", "eio", "kill")
_KEYS = ("rank", "after", "times")
_ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO}


@dataclass(frozen=True)
class InjectionSpec:
    """One parsed ``point:kind[:key=value...]``: fail calls number ``after + 1`` .. ``after + times`` at
    ``point`` (``times`` None: every call from ``after + 1`` on), on global rank ``rank`` (None: every rank)."""

    point: str
    kind: str
    rank: int | None = None
    after: int = 0
    times: int | None = None
    text: str = ""  # the spec as written, for messages

    def fires_at(self, call_number: int) -> bool:
        """Whether the ``call_number``-th (1-based) matching call fails."""
        if call_number <= self.after:
            return False
        return self.times is None or call_number <= self.after + self.times


def _parse_count(spec: str, key: str, value: str, minimum: int) -> int:
    try:
        number = int(value, 10)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ValueError(f"{ENV_VAR} spec {spec!r}: {key}={value!r} must be an integer >= {minimum}")
    return number


def parse_spec(text: str) -> InjectionSpec:
    """Parse one ``point:kind[:key=value...]``; errors name the spec, the bad part and the valid choices."""
    spec = text.strip()
    parts = [part.strip() for part in spec.split(":")]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"{ENV_VAR} spec {spec!r} must look like point:kind[:key=value...], e.g. {_EXAMPLE}")
    point, kind = parts[0], parts[1]
    if point not in POINTS:
        raise ValueError(f"{ENV_VAR} spec {spec!r}: unknown point {point!r}; valid: {', '.join(POINTS)}")
    if kind not in KINDS:
        raise ValueError(f"{ENV_VAR} spec {spec!r}: unknown kind {kind!r}; valid: {', '.join(KINDS)}")
    values: dict[str, int] = {}
    for option in parts[2:]:
        key, equals, value = option.partition("=")
        if not equals or key not in _KEYS:
            raise ValueError(
                f"{ENV_VAR} spec {spec!r}: option {option!r} must be key=value with key one of {', '.join(_KEYS)}"
            )
        if key in values:
            raise ValueError(f"{ENV_VAR} spec {spec!r}: {key} is given twice")
        values[key] = _parse_count(spec, key, value, 1 if key == "times" else 0)
    return InjectionSpec(point, kind, values.get("rank"), values.get("after", 0), values.get("times"), spec)


_EXAMPLE = "checkpoint_write:enospc:rank=1:after=2"


def parse_plan(text: str) -> tuple[InjectionSpec, ...]:
    """Parse the whole variable: specs separated by ``;`` (empty pieces, e.g. a trailing ``;``, are ignored)."""
    return tuple(parse_spec(piece) for piece in text.split(";") if piece.strip())


@dataclass
class InjectionPlan:
    """Parsed specs plus how many calls each point has seen in this process (thread-safe: swap writes run on
    a thread pool)."""

    specs: tuple[InjectionSpec, ...]
    text: str
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def due(self, point: str, rank: int) -> InjectionSpec | None:
        """Count this call at ``point`` and return the spec that makes it fail, if any."""
        with self.lock:
            number = self.calls.get(point, 0) + 1
            self.calls[point] = number
        for spec in self.specs:
            if spec.point == point and spec.rank in (None, rank) and spec.fires_at(number):
                return spec
        return None


# [Note: process-wide injection plan] The plan lives in one module-level slot because the write layers it
# reaches (a swap file's I/O threads, the commit's text writes) hold no engine or config, and launched processes
# configure it only through the environment. It is not distributed state: it is read from this process's
# environment, re-parsed whenever the variable's text changes (tests set it per rank), and calls are counted per
# process. Without the variable ``maybe_fail`` is one dictionary lookup.
_plan: InjectionPlan | None = None
_plan_lock = threading.Lock()


def current_plan() -> InjectionPlan | None:
    """The plan for the current value of ``SHARDSPEED_INJECT`` (None when unset or empty)."""
    global _plan
    text = os.environ.get(ENV_VAR, "")
    if not text.strip():
        return None
    with _plan_lock:
        if _plan is None or _plan.text != text:
            _plan = InjectionPlan(parse_plan(text), text)
        return _plan


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def maybe_fail(point: str, path: str | os.PathLike[str] | None = None) -> None:
    """Raise (or die) here if ``SHARDSPEED_INJECT`` says this call at ``point`` fails; else return at once.

    ``path`` is the file being written, carried by the ``OSError`` as its filename (messages name it)."""
    if ENV_VAR not in os.environ:
        return
    plan = current_plan()
    if plan is None:
        return
    spec = plan.due(point, _rank())
    if spec is None:
        return
    if spec.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    number = _ERRNOS[spec.kind]
    message = f"{os.strerror(number)} (injected by {ENV_VAR}={spec.text!r})"
    if path is None:
        raise OSError(number, message)
    raise OSError(number, message, str(path))
