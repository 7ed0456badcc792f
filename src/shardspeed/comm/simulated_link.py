"""A SIMULATED network link for benchmarks: each collective completes only after its bytes would have crossed a
link of the given bandwidth and latency.

[Note: simulated link] Communication compression pays off where the network, not compute, is the bottleneck —
which a CPU host with gloo over shared memory is not. To measure an end-to-end effect honestly on such a host,
``Collectives`` can model a slower link. The link is ONE per rank (one per ``Collectives``, the rank's NIC) and
serves calls in launch order: a call launched at time t with algorithmic traffic b bytes per rank (the comms
log's figure: ring factors, [Note: comms-log latency] in comm/log.py) starts on the link at
``start = max(t, busy_until)``, is complete at ``max(real completion, start + b / bandwidth + latency)``, and
leaves the link busy until ``start + b / bandwidth``. So calls in flight together (stage 0/2 buckets launched
during backward) share the bandwidth: K concurrent transfers of T seconds each end at T, 2T, ..., KT, as on one
real link; latencies overlap (a pipelined link). The deadline is fixed at *launch*, and only the wait blocks
until it: the caller is never slept at launch, so compute issued between launch and wait overlaps the simulated
transfer exactly as it would overlap a real one, and ``Work.done()`` reads False until the deadline. Synchronous
calls are a launch plus a wait, so they take at least the simulated time too. The model counts from this rank's
own launch, not from the last peer's join (a rank that launches early is not charged for waiting on a late one
beyond the real collective's own wait). Point-to-point messages and ``all_gather_object`` are not delayed.

This is a SIMULATION, off by default: ``communication.simulated_link`` in the config (shardspeed's own key) or
``Collectives(link=...)``. Figures measured under it must be labelled as such.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Hold:
    """When one call's simulated transfer ends (``at``, on its link's clock)."""

    link: SimulatedLink
    at: float

    def passed(self) -> bool:
        return self.link.clock() >= self.at

    def wait(self) -> None:
        """Block until the deadline (returns at once if it passed)."""
        while (remaining := self.at - self.link.clock()) > 0:
            self.link.sleep(remaining)


class SimulatedLink:
    """A link of ``bandwidth_gbps`` Gbit/s with ``latency_us`` µs per call. ``clock`` / ``sleep``: seconds; tests
    pass fakes."""

    def __init__(
        self,
        bandwidth_gbps: float,
        latency_us: float = 0.0,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not bandwidth_gbps > 0 or latency_us < 0:
            raise ValueError(
                f"simulated link: bandwidth_gbps must be > 0 and latency_us >= 0, got {bandwidth_gbps}, {latency_us}"
            )
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_us = latency_us
        self.clock = clock
        self.sleep = sleep
        self.busy_until = float("-inf")
        """When the link finishes serialising the calls already launched (their bytes; latencies overlap)."""

    def transfer_s(self, nbytes: float) -> float:
        """Seconds a call moving ``nbytes`` (algorithmic, per rank) takes on this link."""
        return self.latency_us * 1e-6 + nbytes * 8 / (self.bandwidth_gbps * 1e9)

    def hold(self, nbytes: float) -> Hold:
        """The deadline of a call launched now that moves ``nbytes``: it queues behind the calls in flight on this
        link ([Note: simulated link])."""
        start = max(self.clock(), self.busy_until)
        self.busy_until = start + nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return Hold(self, self.busy_until + self.latency_us * 1e-6)

    def __repr__(self) -> str:
        return f"SimulatedLink({self.bandwidth_gbps} Gbit/s, {self.latency_us} µs)"
