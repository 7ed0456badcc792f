"""Comms log (DeepSpeed's ``comms_logger``): what each collective moved, counted in elements and bytes.

Each record keeps the raw message size and the *algorithmic* traffic per rank — the figure the ZeRO paper
counts — using the usual ring factors for N ranks:
    all-reduce                       2 (N - 1) / N × size
    all-gather / reduce-scatter      (N - 1) / N × (full, unsharded) size
    broadcast                        size (each rank receives it once)
    send / recv (point-to-point)     size at the sender, 0 at the receiver: each message is counted once, where
                                     it is sent; ``elements`` / ``bytes`` hold the message as sent on both sides
Pure bookkeeping: no collectives here, so tests can assert exact figures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

ALGORITHMIC_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


@dataclass
class OpTotals:
    count: int = 0
    elements: int = 0  # full (unsharded) message size in elements
    bytes: int = 0
    algorithmic_elements: float = 0.0  # elements actually sent per rank under a ring algorithm


class CommsLog:
    """Totals per (op, tag). Disabled logs cost one attribute check per collective."""

    def __init__(self, enabled: bool = False, prof_ops: tuple[str, ...] = ()) -> None:
        self.enabled = enabled
        self.prof_ops = frozenset(prof_ops)
        self.totals: dict[str, OpTotals] = defaultdict(OpTotals)

    def record(self, op: str, numel: int, element_size: int, world: int, tag: str = "") -> None:
        if not self.enabled or (self.prof_ops and op not in self.prof_ops):
            return
        totals = self.totals[f"{op}:{tag}" if tag else op]
        totals.count += 1
        totals.elements += numel
        totals.bytes += numel * element_size
        totals.algorithmic_elements += numel * ALGORITHMIC_FACTOR[op](world)

    def algorithmic_elements(self, op_prefix: str = "") -> float:
        return sum(t.algorithmic_elements for k, t in self.totals.items() if k.startswith(op_prefix))

    def reset(self) -> None:
        self.totals.clear()

    def summary(self) -> str:
        lines = [f"{'collective':<32}{'calls':>8}{'elements':>16}{'MB':>12}{'algo elements':>18}"]
        for key in sorted(self.totals):
            t = self.totals[key]
            lines.append(
                f"{key:<32}{t.count:>8}{t.elements:>16}{t.bytes / 2**20:>12.2f}{t.algorithmic_elements:>18.0f}"
            )
        return "\n".join(lines)
