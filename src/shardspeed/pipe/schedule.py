"""Pipeline schedules as pure generators of instructions (DeepSpeed's ``pipe/schedule.py``, Megatron's interleaving).

A schedule is two decisions, kept apart:

1. the *compute order* of each stage: which forward/backward (micro-batch, chunk) it runs next
   (``compute_order``; GPipe, 1F1B, interleaved 1F1B and inference differ only here), and
2. the *plan* derived from it (``_plan_stage``, shared): where the receives, sends, loads and buffer slots go.

[Note: where communication goes] Sends never block and receives do (instructions.py), so a stage only ever waits
in a receive. The plan therefore posts each send as early as possible — first thing in the step after the compute
that produced it, before that step's receive, so a send and the next receive sit side by side (DeepSpeed pairs
SendActivation with RecvGrad the same way; an executor may post them in one ``batch_isend_irecv``) — and receives
as late as possible, right before the compute that consumes the message. One refinement keeps every directed
link FIFO across kinds: under interleaving a link carries activations *and* gradients (with p = 2 both chunks'
traffic shares the two links), and the order the peer sends in need not be the order this stage consumes in. So
before a consuming compute the plan receives every message the peer sends on that link up to and including the
needed one, in the peer's send order (it knows the peer's order: compute orders are pure functions of
(m, p, s, v)). An early receive blocks no longer than the needed one would — the peer sent it first — so this adds
no deadlock; it only fills a buffer slot a little sooner. Without interleaving each link carries one kind in
micro-batch order, and Megatron's interleaved order consumes in send order too, so the built-in schedules never
receive early (tested); the rule keeps any other consistent compute order (a subclass) FIFO-correct.

Step layout: ``[sends of the previous compute…, receives…, LoadMicroBatch?, compute]``; a training schedule's last
step is ``[trailing sends…, ReduceTiedGrads, ReduceGrads, OptimizerStep]``.

[Note: pipeline buffer slots] A slot holds one (micro-batch, chunk)'s input, output and (received) output
gradient. It is taken by the first instruction that fills it (``RecvActivation``, or ``LoadMicroBatch`` on the first
virtual stage) and free again right after the instruction that last reads it: ``SendGrad`` (or ``BackwardPass`` on
the first virtual stage) in training; ``SendActivation`` (or ``ForwardPass`` on the last virtual stage) in
inference. "Right after" is in list order, so a step may refill with its receive a slot its own earlier send just
read: the executor takes a send's tensors when it meets the send (a posted send holds its references). Slots are
shared by the stage's chunks (lowest free first), and ``num_pipe_buffers()`` is the peak the plan reaches — for 1F1B
exactly ``min(p − s, m)``, for GPipe ``m``.
"""

from __future__ import annotations

import abc
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

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

__all__ = [
    "SCHEDULES",
    "ComputeOp",
    "GPipeSchedule",
    "InferenceSchedule",
    "InterleavedSchedule",
    "OneFOneBSchedule",
    "PipeSchedule",
    "TrainSchedule",
    "build_schedule",
]


class ComputeOp(NamedTuple):
    """One forward or backward of micro-batch ``micro_batch`` through local chunk ``chunk``."""

    forward: bool
    micro_batch: int
    chunk: int


@dataclass(frozen=True)
class _Plan:
    steps: tuple[tuple[PipeInstruction, ...], ...]
    buffers: int


class PipeSchedule(abc.ABC):
    """The instructions one stage runs for one batch of ``micro_batches``; see the module docstring.

    Subclasses define ``compute_order(stage_id)`` for *any* stage of the pipeline (the plan needs the peers'
    orders to keep links FIFO); ``steps()`` and ``num_pipe_buffers()`` follow from it.
    """

    train: ClassVar[bool] = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> None:
        for name, value, least in (("micro_batches", micro_batches, 1), ("stages", stages, 1), ("chunks", chunks, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{type(self).__name__}: {name} must be an integer >= {least}, got {value!r}")
        if not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"{type(self).__name__}: stage_id {stage_id!r} is not in [0, {stages})")
        if chunks > 1 and stages < 2:
            # A chunk would send to itself: interleaving exists to fill the bubble between stages.
            raise ValueError(f"{type(self).__name__}: chunks={chunks} virtual stages need at least 2 pipeline stages")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.chunks = chunks
        self._cached_plan: _Plan | None = None

    @abc.abstractmethod
    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        """The forwards/backwards stage ``stage_id`` runs, in order (each (micro-batch, chunk) once per kind)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """One list of instructions per step, executed in list order (layout: module docstring)."""
        for step in self._plan().steps:
            yield list(step)

    def num_pipe_buffers(self) -> int:
        """Buffer slots this stage needs: every instruction's ``buffer`` is below it."""
        return self._plan().buffers

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __repr__(self) -> str:
        chunks = f", chunks={self.chunks}" if self.chunks > 1 else ""
        shape = f"micro_batches={self.micro_batches}, stages={self.stages}, stage_id={self.stage_id}{chunks}"
        return f"{type(self).__name__}({shape})"

    def _plan(self) -> _Plan:
        if self._cached_plan is None:
            self._cached_plan = _plan_stage(
                self.compute_order, self.stage_id, self.stages, self.chunks, train=self.train
            )
        return self._cached_plan


class GPipeSchedule(PipeSchedule):
    """All forwards, then all backwards (GPipe): every stage holds all ``m`` micro-batches' activations."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id, chunks)
        _require_single_chunk(self)

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        m = self.micro_batches
        return [ComputeOp(True, i, 0) for i in range(m)] + [ComputeOp(False, i, 0) for i in range(m)]


class OneFOneBSchedule(PipeSchedule):
    """1F1B (PipeDream-flush, DeepSpeed's ``TrainSchedule``): ``min(p − s − 1, m)`` warm-up forwards, then one
    forward and one backward alternately, then the remaining backwards; at most ``min(p − s, m)`` live buffers."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id, chunks)
        _require_single_chunk(self)

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        m = self.micro_batches
        warmup = min(self.stages - stage_id - 1, m)
        order = [ComputeOp(True, i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [ComputeOp(True, warmup + i, 0), ComputeOp(False, i, 0)]
        order += [ComputeOp(False, i, 0) for i in range(m - warmup, m)]
        return order


TrainSchedule = OneFOneBSchedule  # DeepSpeed's name


class InterleavedSchedule(PipeSchedule):
    """Interleaved 1F1B (Megatron-LM's ``forward_backward_pipelining_with_interleaving``): each rank holds
    ``chunks`` = v model chunks (virtual stages ``c·p + s``), micro-batches go through the chunks in groups of p.

    The k-th forward of a stage is micro-batch ``(k // (p·v))·p + k % p`` on chunk ``(k // p) % v``; backwards
    walk the chunks in reverse. Warm-up: ``2·(p − s − 1) + (v − 1)·p`` forwards (all of them if that reaches
    ``m·v``), then 1F1B, then the remaining backwards. The bubble shrinks by v (``bubble_formula``)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2) -> None:
        super().__init__(micro_batches, stages, stage_id, chunks)
        if chunks < 2:
            raise ValueError(f"InterleavedSchedule needs chunks >= 2 virtual stages per rank, got chunks={chunks}")
        if micro_batches % stages:
            raise ValueError(
                f"InterleavedSchedule: micro_batches={micro_batches} is not divisible by stages={stages} "
                "(interleaving runs micro-batches through the chunks in groups of one per stage)"
            )

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        p, v, m = self.stages, self.chunks, self.micro_batches
        total = m * v
        warmup = min(2 * (p - stage_id - 1) + (v - 1) * p, total)
        forwards = [ComputeOp(True, *_grouped(k, p, v, m)) for k in range(total)]
        backwards = [ComputeOp(False, mb, v - 1 - c) for mb, c in (_grouped(k, p, v, m) for k in range(total))]
        order = forwards[:warmup]
        for k in range(total - warmup):
            order += [forwards[warmup + k], backwards[k]]
        order += backwards[total - warmup :]
        return order


class InferenceSchedule(PipeSchedule):
    """Forwards only (``eval_batch``), in the interleaved grouping when ``chunks`` > 1 (any ``m``: the last group
    is just shorter); no backward, reduce or step instructions."""

    train = False

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        p, v, m = self.stages, self.chunks, self.micro_batches
        return [ComputeOp(True, *_grouped(k, p, v, m)) for k in range(m * v)]


def _grouped(k: int, p: int, v: int, m: int) -> tuple[int, int]:
    """(micro-batch, chunk) of a stage's k-th forward in Megatron's order: groups of p micro-batches pass through
    chunk 0, then chunk 1, …; a last group shorter than p (inference with m % p != 0) is handled alike."""
    group, rest = divmod(k, p * v)
    size = min(p, m - group * p)
    chunk, offset = divmod(rest, size)
    return group * p + offset, chunk


def _require_single_chunk(schedule: PipeSchedule) -> None:
    if schedule.chunks != 1:
        raise ValueError(
            f"{type(schedule).__name__} runs one chunk per stage, got chunks={schedule.chunks} "
            "(virtual stages need the 'interleaved' schedule)"
        )


SCHEDULES: dict[str, type[PipeSchedule]] = {
    "gpipe": GPipeSchedule,
    "1f1b": OneFOneBSchedule,
    "interleaved": InterleavedSchedule,
}


def build_schedule(
    name: str, micro_batches: int, stages: int, stage_id: int, chunks: int = 1, *, train: bool = True
) -> PipeSchedule:
    """The schedule called ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``) for one stage; ``train=False``
    gives the inference schedule over the same chunks, whatever the name."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    if not train:
        return InferenceSchedule(micro_batches, stages, stage_id, chunks)
    return SCHEDULES[name](micro_batches, stages, stage_id, chunks)


class _Slots:
    """Lowest-free-first buffer slots keyed by (micro-batch, chunk); records the peak."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self.held: dict[tuple[int, int], int] = {}

    def take(self, key: tuple[int, int]) -> int:
        if key not in self.held:
            self.held[key] = heapq.heappop(self._free) if self._free else self._take_new()
        return self.held[key]

    def _take_new(self) -> int:
        self._next += 1
        return self._next - 1

    def release(self, key: tuple[int, int]) -> None:
        heapq.heappush(self._free, self.held.pop(key))

    @property
    def peak(self) -> int:
        return self._next


class _Msg(NamedTuple):
    grad: bool
    micro_batch: int
    virtual: int  # the receiving virtual stage


def _outgoing(order: list[ComputeOp], stage: int, stages: int, chunks: int) -> dict[int, list[_Msg]]:
    """Per destination stage, the messages ``stage`` sends, in send order (one per compute that has a peer)."""
    out: dict[int, list[_Msg]] = {}
    for op in order:
        peer = (next_virtual if op.forward else prev_virtual)(stage, op.chunk, stages, chunks)
        if peer is not None:
            out.setdefault(peer[0], []).append(_Msg(not op.forward, op.micro_batch, peer[1] * stages + peer[0]))
    return out


def _plan_stage(
    order_of: Callable[[int], list[ComputeOp]], stage: int, stages: int, chunks: int, *, train: bool
) -> _Plan:
    """Place receives, sends, loads and slots around ``order_of(stage)`` ([Note: where communication goes])."""
    last_virtual = stages * chunks - 1
    incoming: dict[int, list[_Msg]] = {}
    for peer in {(stage - 1) % stages, (stage + 1) % stages} - {stage}:  # the only stages that send to this one
        if (msgs := _outgoing(order_of(peer), peer, stages, chunks).get(stage)) is not None:
            incoming[peer] = msgs
    position = {peer: {msg: i for i, msg in enumerate(msgs)} for peer, msgs in incoming.items()}
    received = dict.fromkeys(incoming, 0)
    slots = _Slots()
    steps: list[tuple[PipeInstruction, ...]] = []
    pending: list[PipeInstruction] = []

    def receive_through(peer: int, needed: _Msg) -> list[PipeInstruction]:
        link, at = incoming.get(peer, []), position.get(peer, {}).get(needed)
        if at is None:
            raise AssertionError(f"stage {stage}: stage {peer} never sends {needed} (compute orders disagree)")
        if at < received[peer]:
            return []  # received early, in the peer's send order, before an earlier consumer's message
        instructions: list[PipeInstruction] = []
        while True:
            msg = link[received[peer]]
            received[peer] += 1
            key = (msg.micro_batch, msg.virtual // stages)
            kind = RecvGrad if msg.grad else RecvActivation
            instructions.append(kind(micro_batch=key[0], chunk=key[1], buffer=slots.take(key)))
            if msg == needed:
                return instructions

    for op in order_of(stage):
        step, pending = pending, []
        key = (op.micro_batch, op.chunk)
        virtual = op.chunk * stages + stage
        fields = {"micro_batch": op.micro_batch, "chunk": op.chunk}
        if op.forward:
            if virtual > 0:
                peer = prev_virtual(stage, op.chunk, stages, chunks)
                step += receive_through(peer[0], _Msg(False, op.micro_batch, virtual))
            if virtual in (0, last_virtual):
                step.append(LoadMicroBatch(**fields, buffer=slots.take(key)))
            buffer = slots.held[key]
            step.append(ForwardPass(**fields, buffer=buffer))
            if virtual < last_virtual:
                pending.append(SendActivation(**fields, buffer=buffer))
            if not train:
                slots.release(key)  # last read: the send just queued (first in the next step), or this forward
        else:
            if virtual < last_virtual:
                peer = next_virtual(stage, op.chunk, stages, chunks)
                step += receive_through(peer[0], _Msg(True, op.micro_batch, virtual))
            buffer = slots.held[key]
            step.append(BackwardPass(**fields, buffer=buffer))
            if virtual > 0:
                pending.append(SendGrad(**fields, buffer=buffer))
            slots.release(key)  # last read: the SendGrad just queued, or this backward
        steps.append(tuple(step))
    if train:
        pending += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    if pending:
        steps.append(tuple(pending))
    return _Plan(steps=tuple(steps), buffers=slots.peak)
