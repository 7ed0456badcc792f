"""``wall_clock_breakdown``: time spent in forward, backward and step, summed between log lines.

Off by default: timing a CUDA step needs a device synchronisation, which costs throughput.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


class PhaseTimers:
    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def report_and_reset(self, steps: int) -> str:
        """'forward 12.1 ms, backward 30.2 ms, step 5.0 ms per step' since the last report."""
        parts = [f"{name} {1000 * total / max(steps, 1):.1f} ms" for name, total in self.totals.items()]
        self.totals.clear()
        return ", ".join(parts) + " per step"
