"""Comms log (DeepSpeed's ``comms_logger``): what each collective moved, how long it took, and how that compares
with the ZeRO traffic theory.

Each record keeps the raw message size and the *algorithmic* traffic per rank — the figure the ZeRO paper
counts — using the usual ring factors for N ranks:
    all-reduce                       2 (N - 1) / N × size
    all-gather / reduce-scatter      (N - 1) / N × (full, unsharded) size
    all-to-all                       (N - 1) / N × the message each rank sends (its own block stays local)
    broadcast                        size (each rank receives it once)
    send / recv (point-to-point)     size at the sender, 0 at the receiver: each message is counted once, where
                                     it is sent; ``elements`` / ``bytes`` hold the message as sent on both sides

[Note: comms-log latency] A call's latency runs from its launch to the moment this process learns it completed:
a synchronous call's duration; for an async call, when its ``Work.wait()`` returns or ``Work.done()`` first sees
it finished — whichever comes first (``Collectives`` hands each Work the ``CommsLog.timer`` made at launch). An
async collective waited long after it landed is thus charged the time until it was looked at: an upper bound of
the wire time, exact for the waits that block. That holds only where the host waits for the wire (gloo, MPI).
NCCL's ``wait()`` — and its synchronous calls — return once the kernel is enqueued on a CUDA stream, so a host
clock would time the launch overhead (µs: a 100 MB all-reduce would read as tens of thousands of Gbps). On an
NCCL group a call is therefore counted but not timed (``OpTotals.enqueue_only``): its latency and bandwidth
cells read ``n/a (nccl)``; CUDA-event timing would need an event per call read back later, left for when a GPU
can test it. Nothing is synchronised to time a call (DeepSpeed's logger waits each op; ours costs two
``perf_counter`` calls per logged call and nothing when disabled). Bandwidths follow NCCL-tests
(doc/PERFORMANCE.md): algorithmic bandwidth = message bytes / latency (the full, unsharded size for all-gather and
reduce-scatter; DeepSpeed's ``tput`` doubles it for all-reduce, and its ``Message Size`` is the per-rank input of
all-gather / reduce-scatter, not our full size), bus bandwidth = algorithmic × 2(N−1)/N for all-reduce, × (N−1)/N
for all-gather, reduce-scatter and all-to-all, × 1 for broadcast and point-to-point. Per (op, tag) they are the
bytes-weighted means, sum(bytes) / sum(latency), over the calls that completed.

Pure bookkeeping: no collectives here, so tests can assert exact figures.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

ALGORITHMIC_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}

BUS_FACTOR = {  # NCCL-tests' bus-bandwidth factors (the receiver of a message sees the same wire as its sender)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}

DATA_PARALLEL_TAGS = ("grads", "params")
"""The tags of ZeRO's own traffic over the data axis: gradient reductions and parameter gathers."""

COMPRESSED_TAG_PREFIXES = ("compressed", "grads_1bit")
"""Tags of 1-bit data-parallel traffic: the 1-bit optimizers' compressed means (``compressed:<buffer>``) and
ZeRO-1/2's compressed gradient reduce-scatter (``grads_1bit``). With ``EXACT_TAG_SUFFIX`` (0/1 Adam's exact fp32
means, ``<Optimizer>:exact``), what the compressed line counts."""

EXACT_TAG_SUFFIX = ":exact"

ZERO_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter"})
"""The ops ZeRO's data-parallel traffic uses: the theory line compares only when ``prof_ops`` keeps them all."""

EVAL_SUFFIX = " (eval)"
"""Appended to the key of a call made during an evaluation forward (``CommsLog.evaluating``): its own row, and
outside the theory's per-step traffic, which counts training micro-steps only."""


@dataclass
class OpTotals:
    count: int = 0
    elements: int = 0  # full (unsharded) message size in elements
    bytes: int = 0
    algorithmic_elements: float = 0.0  # elements actually sent per rank under a ring algorithm
    algorithmic_bytes: float = 0.0  # the same in bytes (calls of one key may mix dtypes: packed signs + scales)
    axis_elements: dict[str, float] = field(default_factory=dict)  # algorithmic elements per mesh axis name
    timed: int = 0  # calls whose completion was seen ([Note: comms-log latency])
    enqueue_only: int = 0  # calls on NCCL groups: the host never sees them complete, so they are not timed
    latency_s: float = 0.0  # launch-to-completion seconds, summed over the timed calls
    timed_bytes: int = 0
    timed_bus_bytes: float = 0.0

    @property
    def axis(self) -> str:
        """The mesh axes the calls went over (``"data"``, ``"tensor"``, ``"p2p"``…; comma-separated)."""
        return ",".join(sorted(a for a in self.axis_elements if a))

    @property
    def mean_latency_ms(self) -> float | None:
        return self.latency_s / self.timed * 1e3 if self.timed else None

    @property
    def algbw_gbps(self) -> float | None:
        """Algorithmic bandwidth in Gbit/s (DeepSpeed's unit): bytes / latency over the timed calls."""
        return self.timed_bytes * 8 / self.latency_s / 1e9 if self.latency_s > 0 else None

    @property
    def busbw_gbps(self) -> float | None:
        return self.timed_bus_bytes * 8 / self.latency_s / 1e9 if self.latency_s > 0 else None


@dataclass(frozen=True)
class ZeroTraffic:
    """What ZeRO should move over the data axis per optimizer step, per rank, in elements (the paper's Ψ = the
    trainable parameters this rank's model replica holds). Ring algorithms, N data-parallel ranks, G micro-steps
    per optimizer step:
        stage 0, 1   one all-reduce (or reduce-scatter + all-gather) at the boundary    2 (N−1)/N Ψ
        stage 2      a reduce-scatter every micro-step + the all-gather after the step  (G+1) (N−1)/N Ψ
        stage 3      gathers in forward and backward + a reduce-scatter, per micro-step 3 G (N−1)/N Ψ
    With G = 1 these are the paper's 2Ψ and 3Ψ (× (N−1)/N). Padding to the world size moves the measured figure a
    little above the theory; stage 3's persistent small parameters (never re-gathered) and units kept gathered from
    forward through backward (``stage3_max_reuse_distance``, default 1e9: not gathered again in backward) move it
    below, down to 2/3 when no unit is released: the demo's GPT reads about 0.72×. Evaluation forwards are not
    counted (``EVAL_SUFFIX``)."""

    stage: int
    numel: int
    dp_world: int
    gradient_accumulation_steps: int = 1

    @property
    def psi_multiple(self) -> float:
        g = self.gradient_accumulation_steps
        return {0: 2.0, 1: 2.0, 2: g + 1.0, 3: 3.0 * g}[self.stage]

    @property
    def elements_per_step(self) -> float:
        n = self.dp_world
        return self.psi_multiple * (n - 1) / n * self.numel if n > 1 else 0.0


_live_logs: weakref.WeakSet[CommsLog] = weakref.WeakSet()
"""[Note: finding the comms log] DeepSpeed keeps one process-wide logger that ``deepspeed.comm.log_summary()``
prints. Ours is per engine (engine.comms_log), passed down explicitly; this weak set only lets that DeepSpeed entry
point find the enabled logs of live engines — no process group or rank is kept here, and a dropped engine's log
leaves it by itself. Every log joins it and ``live_logs`` filters by ``enabled`` when asked, so a log enabled
after construction (``engine.comms_log.enabled = True``) is found too. ``comm.log_summary`` refuses to guess
between several."""


class CommsLog:
    """Totals per (op, tag). Disabled logs cost one attribute check per collective. An ``EngineListener``: it
    counts the optimizer steps it saw, for the per-step comparison with ``theory``."""

    def __init__(
        self,
        enabled: bool = False,
        prof_ops: tuple[str, ...] = (),
        clock: Callable[[], float] = time.perf_counter,
        host_waits: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.host_waits = host_waits
        """Whether a call's wait blocks the host until it lands, so that it can be timed; None: ask each call's
        group (False on NCCL: [Note: comms-log latency]). Tests set it to see the NCCL path on gloo."""
        self._clock = clock  # seconds; tests pass a fake one
        self._evaluating = False  # inside an evaluation forward: calls keyed apart (EVAL_SUFFIX)
        self._generation = 0  # bumped by reset(): calls launched before it are not timed into the new figures
        self.prof_ops = frozenset(prof_ops)
        self.totals: dict[str, OpTotals] = defaultdict(OpTotals)
        self.steps = 0
        """Optimizer steps finished since the last ``reset()`` (``on_step``)."""
        self.theory: ZeroTraffic | None = None
        """The data-parallel traffic ZeRO predicts per step; set by the engine."""
        _live_logs.add(self)  # found by live_logs() whenever it is enabled

    def record(
        self, op: str, numel: int, element_size: int, world: int, tag: str = "", axis: str = "", group: Any = None
    ) -> Callable[[], None] | None:
        """Count one call over ``group`` (None: the default group); returns its completion callback ([Note:
        comms-log latency]), None when not logged or when the host cannot see it complete (NCCL)."""
        if not self.enabled or (self.prof_ops and op not in self.prof_ops):
            return None
        key = (f"{op}:{tag}" if tag else op) + (EVAL_SUFFIX if self._evaluating else "")
        totals = self.totals[key]
        totals.count += 1
        totals.elements += numel
        totals.bytes += numel * element_size
        algorithmic = numel * ALGORITHMIC_FACTOR[op](world)
        totals.algorithmic_elements += algorithmic
        totals.algorithmic_bytes += algorithmic * element_size
        totals.axis_elements[axis] = totals.axis_elements.get(axis, 0.0) + algorithmic
        if not self._host_waits(group):
            totals.enqueue_only += 1
            return None
        return self.timer(key, numel * element_size, BUS_FACTOR[op](world))

    @contextlib.contextmanager
    def evaluating(self, on: bool = True) -> Iterator[None]:
        """Within: calls are keyed ``op:tag (eval)``. An evaluation forward's parameter gathers are not training
        traffic, and no optimizer step follows them for the theory to divide by (the engine enters it for a
        forward in eval mode or without grad)."""
        previous, self._evaluating = self._evaluating, self._evaluating or on
        try:
            yield
        finally:
            self._evaluating = previous

    def _host_waits(self, group: Any) -> bool:
        if self.host_waits is not None:
            return self.host_waits
        return not (dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl")

    def timer(self, key: str, nbytes: int, bus_factor: float) -> Callable[[], None]:
        """A callback that, called once when the call is seen complete, adds its latency since now to ``key``."""
        start, generation = self._clock(), self._generation

        def completed() -> None:
            if generation != self._generation:  # launched before a reset(): not part of these figures
                return
            totals = self.totals[key]
            totals.timed += 1
            totals.latency_s += self._clock() - start
            totals.timed_bytes += nbytes
            totals.timed_bus_bytes += nbytes * bus_factor

        return completed

    def expect(self, config: Any, numel: int, dp_world: int) -> CommsLog:
        """Set ``theory`` from the engine's typed config (ZeRO stage, accumulation steps), ``numel`` = Ψ and the
        data-parallel size; returns the log, which the engine subscribes to its events (``on_step``)."""
        stage, gas = config.zero_optimization.stage, config.gradient_accumulation_steps
        self.theory = ZeroTraffic(stage, numel, dp_world, gas)
        return self

    def on_step(self, report: object) -> None:
        self.steps += 1

    def algorithmic_elements(self, op_prefix: str = "") -> float:
        return sum(t.algorithmic_elements for k, t in self.totals.items() if k.startswith(op_prefix))

    def algorithmic_bytes(self, op_prefix: str = "", tag: str | None = None) -> float:
        """Algorithmic bytes per rank of the keys starting with ``op_prefix`` (and of ``tag`` only, if given)."""
        keys = [k for k in self.totals if k.startswith(op_prefix) and (tag is None or k.partition(":")[2] == tag)]
        return sum(self.totals[k].algorithmic_bytes for k in keys)

    def data_parallel_elements(self) -> float:
        """Algorithmic elements per rank ZeRO moved over the data axis (tags ``grads`` / ``params``)."""
        return sum(
            t.axis_elements.get("data", 0.0)
            for k, t in self.totals.items()
            if k.rpartition(":")[2] in DATA_PARALLEL_TAGS
        )

    def optimizer_bytes(self) -> tuple[float, float]:
        """Algorithmic bytes per rank of the 1-bit tags and of the optimizers' exact fp32 means (training only)."""
        one_bit = exact = 0.0
        for key, t in self.totals.items():
            tag = key.partition(":")[2]
            if tag.endswith(EVAL_SUFFIX):
                continue
            if tag.startswith(COMPRESSED_TAG_PREFIXES):
                one_bit += t.algorithmic_bytes
            elif tag.endswith(EXACT_TAG_SUFFIX):
                exact += t.algorithmic_bytes
        return one_bit, exact

    def compressed_line(self) -> str:
        """The 1-bit optimizers' data-parallel bytes per step against an fp32 ring all-reduce of Ψ elements,
        8Ψ·(N−1)/N bytes ("" when no compressed traffic was logged): the 1/32 the compression buys."""
        one_bit, exact = self.optimizer_bytes()
        if one_bit == 0 or self.steps == 0:
            return ""
        per_step = (one_bit + exact) / self.steps
        head = (
            f"1-bit data-parallel traffic per step: {per_step:,.0f} bytes per rank over {self.steps} step(s) "
            f"(1-bit {one_bit / self.steps:,.0f}, exact fp32 means {exact / self.steps:,.0f})"
        )
        t = self.theory
        if t is None or t.dp_world < 2:
            return head
        ring = 8 * t.numel * (t.dp_world - 1) / t.dp_world
        return f"{head}; fp32 ring all-reduce of Ψ 8Ψ·(N−1)/N = {ring:,.0f} bytes: {32 * per_step / ring:.3f}/32"

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0
        self._generation += 1

    def theory_line(self) -> str:
        """Data-parallel traffic logged per optimizer step against ``theory``, or why there is no comparison."""
        if self.theory is None:
            return "ZeRO traffic theory: not known for this log (set CommsLog.theory)"
        if self.steps == 0:
            return "ZeRO traffic theory: no optimizer step logged yet"
        unlogged = sorted(ZERO_OPS - self.prof_ops) if self.prof_ops else []
        if unlogged:  # a filtered log would read as a fraction of the theory
            return f"ZeRO traffic theory: not compared (comms_logger.prof_ops leaves out {', '.join(unlogged)})"
        t = self.theory
        measured = self.data_parallel_elements() / self.steps
        expected = t.elements_per_step
        ratio = f"{measured / expected:.3f}× theory" if expected else "no data-parallel axis"
        return (
            f"data-parallel traffic per step: {measured:,.0f} elements per rank over {self.steps} step(s); "
            f"ZeRO-{t.stage} theory {t.psi_multiple:g}Ψ·(N−1)/N = {expected:,.0f} "
            f"(Ψ={t.numel:,}, N={t.dp_world}, gas={t.gradient_accumulation_steps}): {ratio}"
        )

    def rows(self) -> dict[str, dict[str, Any]]:
        """The summary as data, per ``op:tag`` (DeepSpeed's ``return_dict`` field names where they exist)."""
        out = {}
        for key in sorted(self.totals):
            t = self.totals[key]
            out[key] = {
                "count": t.count,
                "timed": t.timed,
                "enqueue_only": t.enqueue_only,
                "axis": t.axis,
                "elements": t.elements,
                "msg_size_bytes": t.bytes / t.count if t.count else 0,
                "total_bytes": t.bytes,
                "algorithmic_elements": t.algorithmic_elements,
                "total_latency_ms": t.latency_s * 1e3,
                "avg_latency_ms": t.mean_latency_ms,
                "tput_avg_gbps": t.algbw_gbps,
                "busbw_avg_gbps": t.busbw_gbps,
            }
        return out

    def summary(self) -> str:
        """DeepSpeed's comms table, one row per ``op:tag`` (the mean message size; DeepSpeed splits rows by size),
        plus the calls timed (``Total Latency`` covers only those), elements and algorithmic elements, then the line
        comparing data-parallel traffic with ZeRO's. Rows of NCCL calls read ``n/a (nccl)`` for latency and
        bandwidth ([Note: comms-log latency])."""
        head = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)")
        head += ("busbw_avg (Gbps)", "timed", "elements", "algo elements")
        lines = [f"{head[0]:<32}" + "".join(f"{h:>19}" for h in head[1:])]
        for key, row in self.rows().items():
            untimed = "n/a (nccl)" if row["enqueue_only"] and not row["timed"] else None
            cells = [
                convert_size(row["msg_size_bytes"]),
                str(row["count"]),
                untimed or f"{row['total_latency_ms']:.2f}",
                untimed or _fmt(row["avg_latency_ms"]),
                untimed or _fmt(row["tput_avg_gbps"]),
                untimed or _fmt(row["busbw_avg_gbps"]),
                str(row["timed"]),
                str(row["elements"]),
                f"{row['algorithmic_elements']:.0f}",
            ]
            lines.append(f"{key:<32}" + "".join(f"{c:>19}" for c in cells))
        lines.append(self.theory_line())
        if compressed := self.compressed_line():  # ZeRO's tags leave the 1-bit traffic out: its own line
            lines.append(compressed)
        return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def convert_size(size_bytes: float) -> str:
    """DeepSpeed's human-readable size (1024-based): ``"4.0 KB"``."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = max(0, min(math.floor(math.log(size_bytes, 1024)), len(names) - 1))
    return f"{round(size_bytes / 1024**i, 2)} {names[i]}"


def live_logs() -> list[CommsLog]:
    """The enabled comms logs of live engines ([Note: finding the comms log])."""
    return [log for log in list(_live_logs) if log.enabled]
