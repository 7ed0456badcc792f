"""An event-driven simulator of one pipeline's schedules: timing (the bubble) and correctness, with no process.

``simulate`` runs every stage's instruction stream with the semantics of ``instructions.py``: a send is posted at
the sender's clock and arrives ``p2p_cost`` later; a receive blocks until the head of its link's queue arrived;
forwards and backwards cost ``forward_cost`` / ``backward_cost`` divided by the chunks (a chunk is 1/v of the
stage's layers); loads and step-level instructions cost nothing. Times are exact (integer ticks of the costs'
common denominator inside, ``Fraction``s in the result), so the bubble can be compared with its closed form
exactly.

Each stage runs until it blocks; the round-robin repeats until every stage is done or none can move (a deadlock).
The result does not depend on that order: a stage's clock only ever takes the max of its own time and a message's
arrival, and a link is a FIFO queue (a Kahn process network), so any fair interleaving gives the same times.

What it checks (a ``ScheduleError`` naming the stage, the step and the instruction): a deadlock; a receive that is
not the next message its link carries (FIFO across kinds, the executor's p2p contract); a buffer slot outside
``num_pipe_buffers()``, used before it was filled or overwritten while live; a backward without its forward (or its
received gradient); data loaded on a middle virtual stage; a micro-batch forwarded/backwarded twice or never on a
virtual stage; the step-level instructions missing, repeated, out of order or followed by compute; messages
nobody received.

[Note: the interleaved bubble] With unit costs (f = 1, b = 2, no p2p time), GPipe and 1F1B idle each stage for
exactly (p − 1)(f + b) out of a makespan (m + p − 1)(f + b), a bubble of (p − 1)/(m + p − 1). Interleaving with v
chunks per rank shrinks the ramp to (p − 1)(f + b)/v, so the bubble is (p − 1)/(v·m + p − 1) — Megatron's figure —
and the simulator reproduces it exactly for Megatron's order (tests/unit/test_pipe_simulate.py sweeps p, m, v).
Megatron's warm-up, 2·(p − s − 1) + (v − 1)·p forwards, is p − s − 1 more than that bubble needs: a warm-up of
(p − s − 1) + (v − 1)·p gives the same exact bubble with p − s − 1 fewer live chunk activations when p2p is free.
The extra forwards pay for latency: with a p2p latency c ≤ f/v (one chunk's forward) Megatron's order still
finishes in exactly 3m + 3(p − 1)/v + 2(p·v − 1)·c — the compute plus one micro-batch's unavoidable round trip
through the p·v − 1 links — while the leaner warm-up stalls on every round trip (p = 4, m = 8, v = 2, c = 1/2:
87/2 against 71/2). Both facts are asserted in the tests; we keep Megatron's order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from shardspeed.pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    next_virtual,
    prev_virtual,
)
from shardspeed.pipe.schedule import PipeSchedule

__all__ = [
    "ScheduleError",
    "SimResult",
    "TimeSlice",
    "bubble_formula",
    "bubble_formula_exact",
    "format_timeline",
    "simulate",
]

_STEP_END = (ReduceTiedGrads, ReduceGrads, OptimizerStep)


class ScheduleError(RuntimeError):
    """A schedule that would hang or compute wrongly; the message names the stage, step and instruction."""


@dataclass(frozen=True)
class TimeSlice:
    """One forward/backward on a stage, from ``start`` to ``end``."""

    start: Fraction
    end: Fraction
    instruction: PipeInstruction


@dataclass(frozen=True)
class SimResult:
    """Per-stage figures of one simulated batch (tuples indexed by stage)."""

    stages: int
    micro_batches: int
    chunks: int
    makespan: Fraction
    busy: tuple[Fraction, ...]
    idle: tuple[Fraction, ...]
    peak_buffers: tuple[int, ...]  # live buffer slots (activations held), at most
    steps: tuple[int, ...]
    timeline: tuple[tuple[TimeSlice, ...], ...] = field(repr=False)

    @property
    def bubble_fraction(self) -> Fraction:
        """Idle time over all stages / (stages × makespan)."""
        return sum(self.idle, Fraction(0)) / (self.stages * self.makespan) if self.makespan else Fraction(0)


def bubble_formula_exact(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> Fraction:
    """The bubble's closed form: (p − 1)/(m + p − 1) for ``gpipe``/``1f1b``, (p − 1)/(v·m + p − 1) for
    ``interleaved`` ([Note: the interleaved bubble])."""
    if schedule in ("gpipe", "1f1b"):
        v = 1
    elif schedule == "interleaved":
        v = chunks
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of ['1f1b', 'gpipe', 'interleaved']")
    return Fraction(stages - 1, v * micro_batches + stages - 1)


def bubble_formula(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """``bubble_formula_exact`` as a float."""
    return float(bubble_formula_exact(schedule, stages, micro_batches, chunks))


@dataclass
class _Slot:
    micro_batch: int
    chunk: int
    has_input: bool = False
    has_labels: bool = False
    forwarded: bool = False
    has_grad: bool = False
    backwarded: bool = False


class _Stage:
    """One stage's program counter, clock, buffer slots and bookkeeping."""

    def __init__(self, schedule: PipeSchedule) -> None:
        self.schedule = schedule
        self.id = schedule.stage_id
        self.program = [(i, ins) for i, step in enumerate(schedule.steps()) for ins in step]
        self.steps = 1 + max((i for i, _ in self.program), default=-1)
        self.buffers = schedule.num_pipe_buffers()
        self.pc = 0
        self.clock = 0  # in integer ticks of 1/scale (see simulate): exact and fast
        self.busy = 0
        self.slots: dict[int, _Slot] = {}
        self.peak = 0
        self.forwarded: set[tuple[int, int]] = set()
        self.backwarded: set[tuple[int, int]] = set()
        self.loaded: set[tuple[int, int]] = set()
        self.step_end: list[type] = []
        self.timeline: list[tuple[int, int, PipeInstruction]] = []

    @property
    def done(self) -> bool:
        return self.pc >= len(self.program)

    def where(self) -> str:
        step, ins = self.program[self.pc]
        return f"stage {self.id}, step {step}, {ins!r}"


def simulate(
    schedules: Sequence[PipeSchedule], *, forward_cost: float = 1.0, backward_cost: float = 2.0, p2p_cost: float = 0.0
) -> SimResult:
    """Run all stages of one pipeline (``schedules[s]`` is stage s's); see the module docstring."""
    first = _check_shape(schedules)
    p, v, m = first.stages, first.chunks, first.micro_batches
    exact = {ForwardPass: Fraction(forward_cost) / v, BackwardPass: Fraction(backward_cost) / v}
    scale = math.lcm(*(c.denominator for c in (*exact.values(), Fraction(p2p_cost))))
    costs = {kind: int(c * scale) for kind, c in exact.items()}
    latency = int(Fraction(p2p_cost) * scale)
    if min(*costs.values(), latency) < 0:
        raise ValueError(f"costs must be >= 0, got {forward_cost=}, {backward_cost=}, {p2p_cost=}")
    stages = [_Stage(s) for s in schedules]
    links: dict[tuple[int, int], deque[tuple[tuple[str, int, int], int]]] = {}
    while True:
        progressed = False
        for st in stages:
            while not st.done and _execute(st, p, v, m, costs, latency, links):
                st.pc += 1
                progressed = True
        if all(st.done for st in stages):
            break
        if not progressed:
            blocked = "; ".join(st.where() for st in stages if not st.done)
            raise ScheduleError(f"deadlock: every unfinished stage waits in a receive ({blocked})")
    for st in stages:
        _check_finished(st, p, v, m)
    for (a, b), queue in links.items():
        if queue:
            raise ScheduleError(
                f"link stage {a} -> stage {b}: {len(queue)} message(s) never received, first {queue[0][0]}"
            )
    makespan = max(st.clock for st in stages)

    def time(ticks: int) -> Fraction:
        return Fraction(ticks, scale)

    return SimResult(
        stages=p,
        micro_batches=m,
        chunks=v,
        makespan=time(makespan),
        busy=tuple(time(st.busy) for st in stages),
        idle=tuple(time(makespan - st.busy) for st in stages),
        peak_buffers=tuple(st.peak for st in stages),
        steps=tuple(st.steps for st in stages),
        timeline=tuple(tuple(TimeSlice(time(a), time(b), ins) for a, b, ins in st.timeline) for st in stages),
    )


def _check_shape(schedules: Sequence[PipeSchedule]) -> PipeSchedule:
    if not schedules:
        raise ValueError("simulate needs one schedule per stage, got none")
    first = schedules[0]
    for s, sched in enumerate(schedules):
        shape = (sched.micro_batches, sched.stages, sched.chunks, type(sched).train)
        if shape != (first.micro_batches, first.stages, first.chunks, type(first).train) or sched.stage_id != s:
            raise ValueError(f"schedules[{s}] = {sched!r} does not match stage {s} of {first!r}")
    if len(schedules) != first.stages:
        raise ValueError(f"simulate needs {first.stages} schedules (one per stage), got {len(schedules)}")
    return first


def _execute(st: _Stage, p: int, v: int, m: int, costs: dict, latency: int, links: dict) -> bool:
    """Run the stage's current instruction; False when it must wait (a receive whose message has not been sent)."""
    _, ins = st.program[st.pc]
    train = type(st.schedule).train
    if isinstance(ins, _STEP_END):
        _step_end(st, ins, train)
        return True
    if st.step_end:
        raise ScheduleError(f"{st.where()}: computes or communicates after {st.step_end[-1].__name__}")
    if not (0 <= ins.micro_batch < m and 0 <= ins.chunk < v):
        raise ScheduleError(f"{st.where()}: micro-batch or chunk out of range (m={m}, chunks={v})")
    if not 0 <= ins.buffer < st.buffers:
        raise ScheduleError(f"{st.where()}: buffer outside num_pipe_buffers()={st.buffers}")
    key = (ins.micro_batch, ins.chunk)
    virtual = ins.chunk * p + st.id
    first, last = virtual == 0, virtual == p * v - 1
    slot = st.slots.get(ins.buffer)
    if isinstance(ins, RecvActivation | RecvGrad):
        grad = isinstance(ins, RecvGrad)
        peer = (next_virtual if grad else prev_virtual)(st.id, ins.chunk, p, v)
        if peer is None:
            raise ScheduleError(f"{st.where()}: no virtual stage to receive from")
        queue = links.get((peer[0], st.id))
        if not queue:
            return False
        msg, arrival = queue[0]
        expected = ("gradient" if grad else "activation", ins.micro_batch, ins.chunk)
        if msg != expected:
            raise ScheduleError(
                f"{st.where()}: FIFO mismatch on link stage {peer[0]} -> stage {st.id}: expects {expected}, "
                f"but the next message sent on it is {msg}"
            )
        queue.popleft()
        st.clock = max(st.clock, arrival)
        if grad:
            _require(st, slot, key, "forwarded", "a gradient received before its forward")
            slot.has_grad = True
        else:
            _fill(st, slot, ins, key).has_input = True
        return True
    if isinstance(ins, LoadMicroBatch):
        if not (first or last):
            raise ScheduleError(f"{st.where()}: loads data on middle virtual stage {virtual}")
        slot = _fill(st, slot, ins, key) if slot is None else slot
        if (slot.micro_batch, slot.chunk) != key:
            raise ScheduleError(f"{st.where()}: overwrites buffer {ins.buffer} live with {slot}")
        if key in st.loaded:
            raise ScheduleError(f"{st.where()}: loads micro-batch {key[0]} twice")
        st.loaded.add(key)
        slot.has_input |= first
        slot.has_labels |= last
        return True
    if isinstance(ins, ForwardPass):
        _require(st, slot, key, "has_input", "forward on a buffer before it was filled")
        if last and not slot.has_labels:
            raise ScheduleError(f"{st.where()}: the last virtual stage forwards before loading the labels")
        if key in st.forwarded:
            raise ScheduleError(f"{st.where()}: micro-batch {key[0]} forwarded twice through chunk {key[1]}")
        st.forwarded.add(key)
        slot.forwarded = True
        _compute(st, ins, costs[ForwardPass])
        if not train and last:
            _release(st, ins.buffer)
        return True
    if isinstance(ins, SendActivation | SendGrad):
        grad = isinstance(ins, SendGrad)
        _require(st, slot, key, "backwarded" if grad else "forwarded", "a send of a result not computed yet")
        peer = (prev_virtual if grad else next_virtual)(st.id, ins.chunk, p, v)
        if peer is None:
            raise ScheduleError(f"{st.where()}: no virtual stage to send to")
        msg = ("gradient" if grad else "activation", ins.micro_batch, peer[1])
        links.setdefault((st.id, peer[0]), deque()).append((msg, st.clock + latency))
        if grad or not train:
            _release(st, ins.buffer)
        return True
    if isinstance(ins, BackwardPass):
        if not train:
            raise ScheduleError(f"{st.where()}: a backward in an inference schedule")
        _require(st, slot, key, "forwarded", "a backward without its forward")
        if not last and not slot.has_grad:
            raise ScheduleError(f"{st.where()}: a backward before its output gradient was received")
        if key in st.backwarded:
            raise ScheduleError(f"{st.where()}: micro-batch {key[0]} backwarded twice through chunk {key[1]}")
        st.backwarded.add(key)
        slot.backwarded = True
        _compute(st, ins, costs[BackwardPass])
        if first:
            _release(st, ins.buffer)
        return True
    raise ScheduleError(f"{st.where()}: unknown instruction")


def _fill(st: _Stage, slot: _Slot | None, ins: PipeInstruction, key: tuple[int, int]) -> _Slot:
    if slot is not None:
        raise ScheduleError(f"{st.where()}: overwrites buffer {ins.buffer} live with {slot}")
    slot = st.slots[ins.buffer] = _Slot(*key)
    st.peak = max(st.peak, len(st.slots))
    return slot


def _require(st: _Stage, slot: _Slot | None, key: tuple[int, int], flag: str, what: str) -> None:
    if slot is None or (slot.micro_batch, slot.chunk) != key or not getattr(slot, flag):
        raise ScheduleError(f"{st.where()}: {what} (buffer holds {slot})")


def _release(st: _Stage, buffer: int) -> None:
    del st.slots[buffer]


def _compute(st: _Stage, ins: PipeInstruction, cost: int) -> None:
    st.timeline.append((st.clock, st.clock + cost, ins))
    st.clock += cost
    st.busy += cost


def _step_end(st: _Stage, ins: PipeInstruction, train: bool) -> None:
    if not train:
        raise ScheduleError(f"{st.where()}: an inference schedule must not reduce or step")
    expected = _STEP_END[len(st.step_end)] if len(st.step_end) < len(_STEP_END) else None
    if type(ins) is not expected:
        raise ScheduleError(
            f"{st.where()}: step-level instructions must come once, in the order "
            "ReduceTiedGrads, ReduceGrads, OptimizerStep"
        )
    st.step_end.append(type(ins))


def _check_finished(st: _Stage, p: int, v: int, m: int) -> None:
    train = type(st.schedule).train
    everything = {(mb, c) for mb in range(m) for c in range(v)}
    for kind, done in (("forwarded", st.forwarded), ("backwarded", st.backwarded if train else everything)):
        if missing := sorted(everything - done):
            raise ScheduleError(f"stage {st.id}: (micro-batch, chunk) {missing} never {kind}")
    if train and len(st.step_end) != len(_STEP_END):
        raise ScheduleError(
            f"stage {st.id}: the schedule does not end with ReduceTiedGrads, ReduceGrads, OptimizerStep"
        )
    if st.slots:
        raise ScheduleError(f"stage {st.id}: buffers still live at the end: {st.slots}")


def format_timeline(result: SimResult, *, max_columns: int = 400) -> str:
    """The stage × time grid as text (``F3`` forward / ``B3`` backward of micro-batch 3, ``F3:1`` on chunk 1,
    ``.`` idle), one column per time tick (the gcd of all start/end times), for debugging and reports."""
    times = [t for lane in result.timeline for sl in lane for t in (sl.start, sl.end)] + [result.makespan]
    scale = math.lcm(*(t.denominator for t in times))
    tick = Fraction(math.gcd(*(int(t * scale) for t in times)) or 1, scale)
    columns = min(int(result.makespan / tick), max_columns)

    def label(ins: PipeInstruction) -> str:
        kind = "F" if isinstance(ins, ForwardPass) else "B"
        return f"{kind}{ins.micro_batch}" + (f":{ins.chunk}" if result.chunks > 1 else "")

    width = max([len(label(sl.instruction)) for lane in result.timeline for sl in lane] + [1])
    lines = [f"tick = {tick}, makespan = {result.makespan}, bubble = {result.bubble_fraction}"]
    for s, lane in enumerate(result.timeline):
        cells = ["." * width] * columns
        for sl in lane:
            for c in range(int(sl.start / tick), min(int(sl.end / tick), columns)):
                cells[c] = label(sl.instruction).ljust(width)
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)
