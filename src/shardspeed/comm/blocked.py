"""``BlockedTime``: wall time the training thread spends blocked on communication, by ``op:tag``.

[Note: exposed communication] Communication that overlaps compute costs nothing on the critical path; what a
step pays is the time the calling thread sits in a work handle's ``wait()`` (or in a synchronous collective,
which is a launch plus a wait) before the bytes have arrived. ``Collectives`` times exactly that: every
``Work.wait()`` that still has a pending handle, and every synchronous call, adds its wall time here under
``"<op>:<tag>"`` (``"<op>"`` untagged). A wait on a finished handle, or one already waited, costs and records
nothing, so a prefetch that completed in the shadow of compute shows as (almost) zero. Launch time (gloo copies
inputs when it enqueues) is not counted: the figure is "blocked waiting for peers and wires", the quantity
overlap can hide.

Always on: two ``perf_counter`` calls per real wait. Read per step by benchmarks and tests
(``engine.collectives.blocked``); ``reset()`` between measurements.
"""

from __future__ import annotations

import time
from collections import defaultdict


class BlockedTime:
    """Seconds blocked (and how many blocking waits) per ``op:tag`` key; ``total(prefix)`` sums keys."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.waits: dict[str, int] = defaultdict(int)

    def add(self, key: str, seconds: float) -> None:
        self.seconds[key] += seconds
        self.waits[key] += 1

    def total(self, prefix: str = "") -> float:
        """Seconds blocked in keys starting with ``prefix`` (every key: ``""``)."""
        return sum(s for k, s in self.seconds.items() if k.startswith(prefix))

    def reset(self) -> None:
        self.seconds.clear()
        self.waits.clear()

    def summary(self) -> str:
        lines = [f"{'blocked in':<40}{'waits':>8}{'ms':>12}"]
        for key in sorted(self.seconds, key=lambda k: -self.seconds[k]):
            lines.append(f"{key:<40}{self.waits[key]:>8}{self.seconds[key] * 1e3:>12.2f}")
        return "\n".join(lines)


def timed_wait(meter: BlockedTime | None, key: str, wait: object) -> None:
    """Call ``wait()`` and add its wall time to ``meter`` under ``key`` (just call it without a meter)."""
    if meter is None:
        wait()  # type: ignore[operator]
        return
    start = time.perf_counter()
    try:
        wait()  # type: ignore[operator]
    finally:
        meter.add(key, time.perf_counter() - start)
