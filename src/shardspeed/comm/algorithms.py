"""Which torch.distributed call carries each logical collective, and the bucket size that feeds it well. Pure.

[Note: collective algorithms] A reduce-scatter or an all-gather can be carried by different calls whose cost
depends on the backend's implementation, not on the bytes the ZeRO paper counts:

- reduce-scatter: ``"native"`` (torch's ``reduce_scatter_single``) or ``"all_reduce"``: all-reduce the whole
  input (in place when the caller passes ``clobber_input=True``, else in a scratch copy) and copy this rank's
  slice into the output at ``wait()``. gloo implements its reduce-scatter as an all-reduce underneath, so the
  all-reduce costs the same — and it has a future, so it progresses in the background, where gloo's native
  reduce-scatter is future-less and progresses only inside ``wait()`` (faults/board.py waits it on a helper thread).
- all-gather: ``"native"`` (``all_gather_single``) or ``"broadcast"``: the owner copies its shard into its slice
  of the output, then one async broadcast per owner fills every slice (N handles in one Work). On gloo this is
  about 3× faster than its all-gather for the same bytes (issue 16; measured below).

Both alternatives give bit-identical results to the native op: a broadcast copies bytes, and gloo's reduce-scatter
sums with the all-reduce's own order (tests/dist/test_collective_algorithms.py checks fp32 and bf16, world 2 and 4).
What the comms log records is the *logical* op with its ring traffic, so the ZeRO traffic figures (2Ψ, 3Ψ) stay
the paper's whatever carries them; ``Collectives.algorithm_counts`` says which call ran.

Choice by measurement, not by name. A ``CollectiveChoice`` maps a message size (the unsharded bytes) to an
algorithm per op — a crossover is a size range — and keeps the measured bandwidth curve. Where it comes from
(``communication.collectives``, resolved in comm/calibrate.py): ``"native"`` → ``NATIVE``; NCCL → ``NATIVE``
always (its native ops are the fast path); ``"auto"`` on gloo → a per-host cache of an earlier calibration if
every rank of the world has the same one, else ``table_choice`` below; ``"calibrate"`` → the cache, else a short
measurement at start-up (world rank 0's decision used by every rank: two ranks on different algorithms would hang).
The choice is measured on the data axis and applies there only (``CollectiveChoice.axis``): collectives over any
other axis — tensor-parallel mappings, pipe partition gathers — run native ([Note: agreed calibration]).

Decision rule (``choose``): per op, at most one crossover — all native, all the alternative, or the alternative
below / above one cut (halfway, geometrically, between two ladder sizes) — whichever plan has the least total
log-time over the ladder, an alternative's times counted ``1 / MARGIN`` longer so native wins near-ties. One
crossover at most because a measured curve flips back and forth under noise (a loaded machine), and a plan
fitted to every wiggle would pick an algorithm per size at random; sums of log-times weigh every size alike.

NCCL coalescing: not done here. The engine launches several buckets together in one place (stages 1/2's parameter
gather after the step, zero/partitioned.py); wrapping that loop in ``torch.distributed._coalescing_manager`` would
make them one NCCL group call, but it is a private API whose handle semantics changed across torch releases and no
GPU was available to measure it, so the buckets stay separate async calls (NCCL still runs them back to back on one
stream). Left for the GPU check to measure.

Bucket size (``default_bucket_numel``): the knee of the bus-bandwidth curve — the smallest ladder size whose
combined reduce-scatter + all-gather bus bandwidth (chosen algorithms; nccl-tests' busbw, (N-1)/N × bytes per
op) reaches ``KNEE_FRACTION`` (90%) of the best measured. Bigger buckets only add latency before the first
launch and staging memory; smaller ones pay per-call overhead. The engine uses it for ``reduce_bucket_size`` /
``allgather_bucket_size`` when the config does not set them (engine_setup.bucket_defaults), with one exception:

[Note: overlap needs a spare core] Buckets communicated while compute runs (gradients reduced during backward,
parameters gathered during the next forward) only win if the backend's worker thread gets a core of its own: gloo
reduces and copies CPU tensors on its worker thread, so with fewer than two cores per rank (``cores_per_rank``,
agreed at startup: the CPUs this rank may run on, shared by the ranks on its host, the minimum over hosts) the
communication steals the cycles compute needs, and more buckets only add launches. Measured on the 2-core VM,
world 2 (one core per rank), the comm-bound MLP, wall ms per step (3 × 10 steps, two runs): stage 1 with knee
buckets (12 per step) 103-113, with 3.2M-element buckets 93-107, with one 5e8-element bucket 81-90; stage 2
105-112 / 96-107 / 84-90; stage 0 with knee buckets 1.11× DDP's step time, one bucket 1.01× (issue #16). There
both bucket sizes keep DeepSpeed's default (one bucket for this model); with a spare core they default to the knee.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ReduceScatterAlgo = Literal["native", "all_reduce"]
AllGatherAlgo = Literal["native", "broadcast"]
CANDIDATES: dict[str, tuple[str, ...]] = {
    "reduce_scatter": ("native", "all_reduce"),
    "all_gather": ("native", "broadcast"),
}
MARGIN = 0.9
"""An alternative's times count 1/MARGIN longer: it must be ~10% faster over its range to replace native."""
KNEE_FRACTION = 0.9
"""The knee: the smallest size reaching this fraction of the best bus bandwidth."""
FORMAT = 1
"""Version of the serialized form (cache files); another version is ignored."""


@dataclass(frozen=True)
class SizeRule:
    """``algorithm`` for messages of at most ``max_bytes`` unsharded bytes (None: no upper bound)."""

    max_bytes: int | None
    algorithm: str


@dataclass(frozen=True)
class CurvePoint:
    """One ladder size: unsharded bytes and the bus bandwidth (GB/s) of a reduce-scatter + all-gather pair with
    the chosen algorithms."""

    nbytes: int
    bus_gbps: float


@dataclass(frozen=True)
class Timing:
    """One measurement: the max over ranks of each rank's median seconds for ``op`` by ``algorithm``."""

    op: str
    algorithm: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class CollectiveChoice:
    """The algorithm per op by message size, and the bandwidth curve it was chosen from. Default: all native
    (what ``Collectives()`` built anywhere does)."""

    reduce_scatter: tuple[SizeRule, ...] = (SizeRule(None, "native"),)
    all_gather: tuple[SizeRule, ...] = (SizeRule(None, "native"),)
    curve: tuple[CurvePoint, ...] = ()
    itemsize: int = 4
    """Bytes per element of the measured dtype (the curve's sizes in elements = bytes / itemsize)."""
    source: str = field(default="native", compare=False)
    """Where it came from: native, table, cache, calibration (logged on rank 0)."""
    timings: tuple[Timing, ...] = field(default=(), compare=False)
    cores_per_rank: float | None = field(default=None, compare=False)
    """CPU cores per rank, agreed world-wide (the fewest on any host; [Note: overlap needs a spare core]); None:
    not measured (native choices)."""
    axis: str | None = field(default=None, compare=False)
    """The name of the axis the choice was agreed for (the engine's: ``"data"``); ``Collectives`` runs every other
    axis native, since nothing agreed a choice over it. None: every axis (a test's forced choice, a measurement)."""

    def applies_to(self, axis_name: str) -> bool:
        return self.axis is None or self.axis == axis_name

    def algorithm(self, op: str, nbytes: int) -> str:
        """The algorithm for ``op`` on a message of ``nbytes`` unsharded bytes."""
        rules = self.reduce_scatter if op == "reduce_scatter" else self.all_gather
        for rule in rules:
            if rule.max_bytes is None or nbytes <= rule.max_bytes:
                return rule.algorithm
        return "native"

    @property
    def is_native(self) -> bool:
        return all(r.algorithm == "native" for r in (*self.reduce_scatter, *self.all_gather))

    def describe(self) -> str:
        """One line for the rank-0 log."""

        def rules(rs: tuple[SizeRule, ...]) -> str:
            return ", ".join(f"{r.algorithm}" + (f" ≤{_human(r.max_bytes)}" if r.max_bytes else "") for r in rs)

        knee = default_bucket_numel(self)
        tail = f"; bucket knee {knee:,} elements" if knee else ""
        rs, ag = rules(self.reduce_scatter), rules(self.all_gather)
        return f"collectives ({self.source}): reduce_scatter {rs}; all_gather {ag}{tail}"


NATIVE = CollectiveChoice()


def bus_bytes(nbytes: int, world: int) -> float:
    """nccl-tests' bus bytes of one reduce-scatter or all-gather of ``nbytes`` unsharded bytes."""
    return nbytes * (world - 1) / world


def choose(timings: Sequence[Timing], world: int, itemsize: int, source: str = "calibration") -> CollectiveChoice:
    """The choice from measurements (see the decision rule in [Note: collective algorithms])."""
    by: dict[tuple[str, str, int], float] = {(t.op, t.algorithm, t.nbytes): t.seconds for t in timings}
    sizes = sorted({t.nbytes for t in timings})
    rules: dict[str, tuple[SizeRule, ...]] = {}
    best_time: dict[str, list[float]] = {}
    for op, (native, *alternatives) in CANDIDATES.items():
        plans = [[native] * len(sizes)]
        for alt in alternatives:
            plans += [
                [alt if below == (i < cut) else native for i in range(len(sizes))]
                for cut in range(len(sizes) + 1)
                for below in (True, False)
            ]
        costs = [_plan_cost(by, op, native, sizes, plan) for plan in plans]
        plan = plans[costs.index(min(costs))]  # the first of equals: all native before any alternative
        rules[op] = _ranges(sizes, plan)
        best_time[op] = [by.get((op, algo, size), math.inf) for algo, size in zip(plan, sizes, strict=True)]
    curve = tuple(
        CurvePoint(size, 2 * bus_bytes(size, world) / (rs + ag) / 1e9)
        for size, rs, ag in zip(sizes, best_time["reduce_scatter"], best_time["all_gather"], strict=True)
        if math.isfinite(rs + ag) and rs + ag > 0
    )
    return CollectiveChoice(rules["reduce_scatter"], rules["all_gather"], curve, itemsize, source, tuple(timings))


def _plan_cost(
    by: dict[tuple[str, str, int], float], op: str, native: str, sizes: Sequence[int], plan: Sequence[str]
) -> float:
    """Sum over sizes of log(time), an alternative's time divided by ``MARGIN`` (native wins near-ties); a size
    a plan's algorithm was not measured at makes the plan impossible."""
    cost = 0.0
    for size, algo in zip(sizes, plan, strict=True):
        t = by.get((op, algo, size), math.inf)
        if not (math.isfinite(t) and t > 0):
            return math.inf
        cost += math.log(t if algo == native else t / MARGIN)
    return cost


def _ranges(sizes: Sequence[int], winners: Sequence[str]) -> tuple[SizeRule, ...]:
    """Consecutive sizes with one winner as one rule; a cut halfway (geometric mean) between ladder sizes."""
    if not sizes:
        return (SizeRule(None, "native"),)
    rules: list[SizeRule] = []
    for i in range(1, len(sizes)):
        if winners[i] != winners[i - 1]:
            rules.append(SizeRule(int(math.sqrt(sizes[i - 1] * sizes[i])), winners[i - 1]))
    rules.append(SizeRule(None, winners[-1]))
    return tuple(rules)


OVERLAP_MIN_CORES = 2.0  # a rank's compute thread plus the backend's worker thread ([Note: overlap needs a spare core])


def cores_per_rank(placements: Sequence[tuple[str, Sequence[int]]]) -> float:
    """(host, CPUs the rank may run on) of every rank → cores per rank on the most crowded host: a host's ranks
    share the union of their CPUs."""
    hosts: dict[str, tuple[set[int], int]] = {}
    for host, cpus in placements:
        union, ranks = hosts.get(host, (set(), 0))
        hosts[host] = (union | set(cpus), ranks + 1)
    return min(len(union) / ranks for union, ranks in hosts.values())


def knee_bytes(curve: Sequence[CurvePoint], fraction: float = KNEE_FRACTION) -> int | None:
    """The smallest size whose bus bandwidth reaches ``fraction`` of the best on the curve (None: no curve)."""
    if not curve:
        return None
    best = max(p.bus_gbps for p in curve)
    return min(p.nbytes for p in curve if p.bus_gbps >= fraction * best)


def default_bucket_numel(choice: CollectiveChoice) -> int | None:
    """Bucket elements at the knee of ``choice``'s bandwidth curve; None without a curve (native, NCCL) or without a
    spare core per rank ([Note: overlap needs a spare core]): the config's defaults stay."""
    if choice.cores_per_rank is not None and choice.cores_per_rank < OVERLAP_MIN_CORES:
        return None
    knee = knee_bytes(choice.curve)
    return None if knee is None else max(1, knee // choice.itemsize)


# --- the documented table ----------------------------------------------------------------------------------------
# gloo on CPU over loopback, fp32, measured by `python -m shardspeed.comm.calibrate --world N --reps 7` (ladder
# 16 KiB..16 MiB unsharded, ×4 steps; per size the max over ranks of each rank's median of 7 after a warm-up),
# three runs per world size, the median of the three per entry below. 2026-12-02 ~05:05 UTC, the shared 2-core
# development VM (five other jobs running: load ~3; world 4 is oversubscribed 2×), torch 2.13 CPU. Indicative:
# single runs disagreed by up to 2× per entry. ms per call (bus GB/s = (N-1)/N × bytes / time):
#
#   world 2                  16K            64K           256K            1M             4M            16M
#   reduce_scatter native    6.718 (0.00)   1.394 (0.02)   2.703 (0.05)   5.148 (0.10)  13.098 (0.16)  47.623 (0.18)
#   reduce_scatter all_red.  1.133 (0.01)   1.135 (0.03)   1.892 (0.07)   3.130 (0.17)   8.934 (0.23)  31.867 (0.26)
#   all_gather native        0.811 (0.01)   1.060 (0.03)   1.525 (0.09)   2.318 (0.23)   5.687 (0.37)  63.614 (0.13)
#   all_gather broadcast     1.216 (0.01)   0.927 (0.04)   1.125 (0.12)   2.156 (0.24)   7.125 (0.29)  35.253 (0.24)
#   → reduce_scatter all_reduce; all_gather native ≤ 8 MiB, broadcast above; knee 4 MiB (1,048,576 fp32)
#
#   world 4                  16K            64K           256K            1M             4M            16M
#   reduce_scatter native    8.459 (0.00)  13.896 (0.00)  11.478 (0.02)  19.298 (0.04)  36.388 (0.09) 168.797 (0.07)
#   reduce_scatter all_red. 11.841 (0.00)  16.177 (0.00)  14.688 (0.01)  14.355 (0.05)  26.154 (0.12) 110.982 (0.11)
#   all_gather native        5.759 (0.00)   8.041 (0.01)   8.063 (0.02)   8.142 (0.10)  20.257 (0.16)  95.943 (0.13)
#   all_gather broadcast     6.597 (0.00)   6.701 (0.01)   6.001 (0.03)   8.550 (0.09)  15.803 (0.20)  46.927 (0.27)
#   → reduce_scatter native ≤ 512 KiB, all_reduce above; all_gather native ≤ 32 KiB, broadcast above; knee 4 MiB
#
# The table keeps the timings themselves: the rule (``choose``) and the knee are derived from them exactly as a
# calibration's are, and a reader can check them. Not in these figures: gloo's native reduce-scatter has no
# future and progresses only inside ``wait()``, while an all-reduce progresses in the background — so under
# overlap (buckets launched during backward) all-reduce-then-slice gains more than a synchronous timing shows.
_GLOO_TIMINGS: dict[int, tuple[tuple[str, str, int, float], ...]] = {
    2: (
        ("reduce_scatter", "native", 16384, 6.718),
        ("reduce_scatter", "all_reduce", 16384, 1.133),
        ("all_gather", "native", 16384, 0.811),
        ("all_gather", "broadcast", 16384, 1.216),
        ("reduce_scatter", "native", 65536, 1.394),
        ("reduce_scatter", "all_reduce", 65536, 1.135),
        ("all_gather", "native", 65536, 1.060),
        ("all_gather", "broadcast", 65536, 0.927),
        ("reduce_scatter", "native", 262144, 2.703),
        ("reduce_scatter", "all_reduce", 262144, 1.892),
        ("all_gather", "native", 262144, 1.525),
        ("all_gather", "broadcast", 262144, 1.125),
        ("reduce_scatter", "native", 1048576, 5.148),
        ("reduce_scatter", "all_reduce", 1048576, 3.130),
        ("all_gather", "native", 1048576, 2.318),
        ("all_gather", "broadcast", 1048576, 2.156),
        ("reduce_scatter", "native", 4194304, 13.098),
        ("reduce_scatter", "all_reduce", 4194304, 8.934),
        ("all_gather", "native", 4194304, 5.687),
        ("all_gather", "broadcast", 4194304, 7.125),
        ("reduce_scatter", "native", 16777216, 47.623),
        ("reduce_scatter", "all_reduce", 16777216, 31.867),
        ("all_gather", "native", 16777216, 63.614),
        ("all_gather", "broadcast", 16777216, 35.253),
    ),
    4: (
        ("reduce_scatter", "native", 16384, 8.459),
        ("reduce_scatter", "all_reduce", 16384, 11.841),
        ("all_gather", "native", 16384, 5.759),
        ("all_gather", "broadcast", 16384, 6.597),
        ("reduce_scatter", "native", 65536, 13.896),
        ("reduce_scatter", "all_reduce", 65536, 16.177),
        ("all_gather", "native", 65536, 8.041),
        ("all_gather", "broadcast", 65536, 6.701),
        ("reduce_scatter", "native", 262144, 11.478),
        ("reduce_scatter", "all_reduce", 262144, 14.688),
        ("all_gather", "native", 262144, 8.063),
        ("all_gather", "broadcast", 262144, 6.001),
        ("reduce_scatter", "native", 1048576, 19.298),
        ("reduce_scatter", "all_reduce", 1048576, 14.355),
        ("all_gather", "native", 1048576, 8.142),
        ("all_gather", "broadcast", 1048576, 8.550),
        ("reduce_scatter", "native", 4194304, 36.388),
        ("reduce_scatter", "all_reduce", 4194304, 26.154),
        ("all_gather", "native", 4194304, 20.257),
        ("all_gather", "broadcast", 4194304, 15.803),
        ("reduce_scatter", "native", 16777216, 168.797),
        ("reduce_scatter", "all_reduce", 16777216, 110.982),
        ("all_gather", "native", 16777216, 95.943),
        ("all_gather", "broadcast", 16777216, 46.927),
    ),
}


def table_choice(backend: str, world: int, itemsize: int = 4) -> CollectiveChoice:
    """The documented choice for ``backend`` and an axis of ``world`` ranks: NCCL and unknown backends native;
    gloo from the timings measured here (the nearest measured world size)."""
    if backend != "gloo" or world < 2 or not _GLOO_TIMINGS:
        return NATIVE
    measured = min(_GLOO_TIMINGS, key=lambda w: (abs(w - world), w))
    timings = [Timing(op, algo, nbytes, ms / 1e3) for op, algo, nbytes, ms in _GLOO_TIMINGS[measured]]
    return choose(timings, world, itemsize, source=f"table (gloo, measured at world {measured})")


# --- serialized form (the per-host cache: comm/calibrate.py) ------------------------------------------------------
def to_json(choice: CollectiveChoice, key: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "key": key,
        "reduce_scatter": [[r.max_bytes, r.algorithm] for r in choice.reduce_scatter],
        "all_gather": [[r.max_bytes, r.algorithm] for r in choice.all_gather],
        "curve": [[p.nbytes, p.bus_gbps] for p in choice.curve],
        "itemsize": choice.itemsize,
        "timings": [[t.op, t.algorithm, t.nbytes, t.seconds] for t in choice.timings],
    }


def from_json(data: Any, key: dict[str, Any]) -> CollectiveChoice:
    """The choice in ``data``; ``ValueError`` naming what is wrong (another key, format, an unknown algorithm)."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    if data.get("key") != key:
        raise ValueError(f"made for {data.get('key')!r}, not {key!r}")
    try:
        rules = {op: tuple(SizeRule(_opt_int(m), str(a)) for m, a in data[op]) for op in CANDIDATES}
        curve = tuple(CurvePoint(int(n), float(g)) for n, g in data["curve"])
        timings = tuple(Timing(str(o), str(a), int(n), float(s)) for o, a, n, s in data.get("timings", []))
        itemsize = int(data["itemsize"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"malformed: {error!r}") from None
    for op, op_rules in rules.items():
        if not op_rules or op_rules[-1].max_bytes is not None:
            raise ValueError(f"{op}: the last rule must have no upper bound")
        unknown = [r.algorithm for r in op_rules if r.algorithm not in CANDIDATES[op]]
        if unknown:
            raise ValueError(f"{op}: unknown algorithm {unknown[0]!r}")
    return CollectiveChoice(
        rules["reduce_scatter"], rules["all_gather"], curve, itemsize, source="cache", timings=timings
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g}{unit}"
    return f"{nbytes}B"
