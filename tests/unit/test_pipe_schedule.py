"""Pipeline schedules (pipe/schedule.py) as pure generators: compute orders, buffer counts, step layout, where data
is loaded and how the batch ends — no process group. Timing and cross-stage checks: test_pipe_simulate.py."""

from __future__ import annotations

import itertools

import pytest

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
)
from shardspeed.pipe.schedule import (
    ComputeOp,
    GPipeSchedule,
    InferenceSchedule,
    InterleavedSchedule,
    OneFOneBSchedule,
    PipeSchedule,
    TrainSchedule,
    build_schedule,
)
from shardspeed.pipe.simulate import simulate

STEP_END = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)
COMPUTE = (ForwardPass, BackwardPass)


def _grid(name: str) -> list[tuple[int, int, int]]:
    """(stages, micro_batches, chunks) the sweeps cover for ``name`` (interleaving: m divisible by p)."""
    if name == "interleaved":
        return [(p, m, v) for p in range(2, 9) for m in range(p, 17, p) for v in (2, 3, 4)]
    return [(p, m, 1) for p in range(1, 9) for m in range(1, 17)]


def _all_stages(name: str, p: int, m: int, v: int, *, train: bool = True) -> list[PipeSchedule]:
    return [build_schedule(name, m, p, s, v, train=train) for s in range(p)]


def _flat(schedule: PipeSchedule) -> list[PipeInstruction]:
    return [ins for step in schedule.steps() for ins in step]


def test_build_schedule_names_and_classes() -> None:
    assert type(build_schedule("gpipe", 4, 2, 0)) is GPipeSchedule
    assert type(build_schedule("1f1b", 4, 2, 1)) is OneFOneBSchedule
    assert TrainSchedule is OneFOneBSchedule  # DeepSpeed's name
    sched = build_schedule("interleaved", 4, 2, 1, 3)
    assert type(sched) is InterleavedSchedule
    assert (sched.micro_batches, sched.stages, sched.stage_id, sched.chunks) == (4, 2, 1, 3)
    assert type(build_schedule("1f1b", 4, 2, 0, train=False)) is InferenceSchedule
    assert build_schedule("interleaved", 5, 2, 0, 2, train=False).chunks == 2  # inference: any m
    with pytest.raises(ValueError, match=r"'zero-bubble'.*\['1f1b', 'gpipe', 'interleaved'\]"):
        build_schedule("zero-bubble", 4, 2, 0)


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match=r"micro_batches=6 is not divisible by stages=4"):
        InterleavedSchedule(6, 4, 0, 2)
    with pytest.raises(ValueError, match=r"chunks >= 2.*chunks=1"):
        InterleavedSchedule(4, 2, 0, 1)
    with pytest.raises(ValueError, match=r"InterleavedSchedule: chunks=2 virtual stages need at least 2 pipeline"):
        InterleavedSchedule(4, 1, 0, 2)
    with pytest.raises(ValueError, match=r"InferenceSchedule: chunks=3 virtual stages need at least 2 pipeline"):
        build_schedule("interleaved", 4, 1, 0, 3, train=False)
    with pytest.raises(ValueError, match=r"OneFOneBSchedule runs one chunk per stage, got chunks=2"):
        build_schedule("1f1b", 4, 2, 0, 2)
    with pytest.raises(ValueError, match=r"GPipeSchedule runs one chunk"):
        GPipeSchedule(4, 2, 0, 3)
    with pytest.raises(ValueError, match=r"stage_id 2 is not in \[0, 2\)"):
        OneFOneBSchedule(4, 2, 2)
    with pytest.raises(ValueError, match=r"micro_batches must be an integer >= 1, got 0"):
        GPipeSchedule(0, 2, 0)


def test_1f1b_order_warmup_steady_cooldown() -> None:
    """Stage s runs min(p − s − 1, m) warm-up forwards, alternates, then drains the backwards."""
    f, b = (lambda i: ComputeOp(True, i, 0)), (lambda i: ComputeOp(False, i, 0))
    sched = OneFOneBSchedule(6, 4, 1)
    assert sched.compute_order(1) == [f(0), f(1), f(2), b(0), f(3), b(1), f(4), b(2), f(5), b(3), b(4), b(5)]
    assert sched.compute_order(3) == [x for i in range(6) for x in (f(i), b(i))]
    assert OneFOneBSchedule(2, 4, 0).compute_order(0) == [f(0), f(1), b(0), b(1)]  # warm-up capped at m
    assert GPipeSchedule(3, 2, 0).compute_order(1) == [f(0), f(1), f(2), b(0), b(1), b(2)]


def test_interleaved_order_is_megatrons() -> None:
    """Forwards in groups of p micro-batches per chunk; backwards through the chunks in reverse; warm-up
    2·(p − s − 1) + (v − 1)·p forwards."""
    sched = InterleavedSchedule(4, 2, 0, 2)
    f, b = (lambda i, c: ComputeOp(True, i, c)), (lambda i, c: ComputeOp(False, i, c))
    assert sched.compute_order(0) == [
        *(f(0, 0), f(1, 0), f(0, 1), f(1, 1)),  # warm-up: 2·1 + 1·2 = 4
        *(f(2, 0), b(0, 1), f(3, 0), b(1, 1), f(2, 1), b(0, 0), f(3, 1), b(1, 0)),
        *(b(2, 1), b(3, 1), b(2, 0), b(3, 0)),
    ]
    assert sched.compute_order(1)[:3] == [f(0, 0), f(1, 0), f(0, 1)]  # warm-up 2, then 1F1B
    assert sched.compute_order(1)[3] == b(0, 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_step_layout_and_counts(name: str) -> None:
    """Every step is [sends…, receives…, load?, one compute], its receives all for that compute (the built-in
    orders never receive early); a training stage runs 2·m·v compute steps and
    ends with one step of its trailing sends and ReduceTiedGrads, ReduceGrads, OptimizerStep (each once, in that
    order, nowhere else); every buffer is below num_pipe_buffers()."""
    for p, m, v in _grid(name):
        for sched in _all_stages(name, p, m, v):
            steps = list(sched.steps())
            assert len(steps) == 2 * m * v + 1
            *compute_steps, last = steps
            assert [type(i) for i in last if not isinstance(i, SENDS)] == list(STEP_END)
            assert all(isinstance(i, SENDS) for i in last[: len(last) - 3])
            for step in compute_steps:
                kinds = [0 if isinstance(i, SENDS) else 1 if isinstance(i, RECVS) else 2 for i in step]
                assert kinds == sorted(kinds) and isinstance(step[-1], COMPUTE), step
                assert sum(isinstance(i, COMPUTE) for i in step) == 1
                compute = (step[-1].micro_batch, step[-1].chunk)
                assert all((i.micro_batch, i.chunk) == compute for i in step if isinstance(i, RECVS))  # none early
            buffers = sched.num_pipe_buffers()
            assert all(0 <= i.buffer < buffers for i in _flat(sched) if not isinstance(i, STEP_END))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_sends_posted_in_the_step_after_their_compute(name: str) -> None:
    """A compute's send is the first thing after it (before the next blocking receive): DeepSpeed's pairing of
    SendActivation with RecvGrad, SendGrad with RecvActivation."""
    for p, m, v in _grid(name)[::5]:
        for sched in _all_stages(name, p, m, v):
            steps = list(sched.steps())
            for step, following in itertools.pairwise(steps):
                ins = step[-1]
                virtual = ins.chunk * p + sched.stage_id
                has_peer = virtual < p * v - 1 if isinstance(ins, ForwardPass) else virtual > 0
                sends = [i for i in following if isinstance(i, SENDS)]
                if has_peer:
                    kind = SendActivation if isinstance(ins, ForwardPass) else SendGrad
                    assert sends == [kind(micro_batch=ins.micro_batch, chunk=ins.chunk, buffer=ins.buffer)]
                else:
                    assert sends == []


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_loads_only_on_first_and_last_virtual_stage(name: str) -> None:
    """LoadMicroBatch once per micro-batch on the first virtual stage (inputs) and the last (labels), before that
    micro-batch's forward there; never elsewhere."""
    for p, m, v in _grid(name)[::3]:
        for sched in _all_stages(name, p, m, v):
            flat = _flat(sched)
            loads = [(i.micro_batch, i.chunk) for i in flat if isinstance(i, LoadMicroBatch)]
            ends = [c for c in range(v) if c * p + sched.stage_id in (0, p * v - 1)]
            assert sorted(loads) == sorted((mb, c) for mb in range(m) for c in ends)
            for k, ins in enumerate(flat):
                if isinstance(ins, LoadMicroBatch):
                    forward = next(i for i in flat[k:] if isinstance(i, ForwardPass))
                    assert (forward.micro_batch, forward.chunk, forward.buffer) == (
                        ins.micro_batch,
                        ins.chunk,
                        ins.buffer,
                    )


def test_buffer_counts() -> None:
    """1F1B needs exactly min(p − s, m) slots (never more than p: DeepSpeed allocates max(2, p − s + 1)), GPipe m,
    interleaving Megatron's min(2·(p − s − 1) + (v − 1)·p + 1, m·v) chunk activations."""
    for p, m, _ in _grid("1f1b"):
        for s in range(p):
            assert OneFOneBSchedule(m, p, s).num_pipe_buffers() == min(p - s, m) <= p
            assert GPipeSchedule(m, p, s).num_pipe_buffers() == m
    for p, m, v in _grid("interleaved"):
        for s in range(p):
            assert InterleavedSchedule(m, p, s, v).num_pipe_buffers() == min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)


def test_1f1b_literal_steps() -> None:
    """The exact plan for p = 2, m = 3 (stage 0 keeps two slots, stage 1 one)."""

    def ins(kind: type[PipeInstruction], mb: int, buf: int) -> PipeInstruction:
        return kind(micro_batch=mb, chunk=0, buffer=buf)

    L, F, B, SA, RA, SG, RG = (
        LoadMicroBatch,
        ForwardPass,
        BackwardPass,
        SendActivation,
        RecvActivation,
        SendGrad,
        RecvGrad,
    )
    end = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    assert list(OneFOneBSchedule(3, 2, 0).steps()) == [
        [ins(L, 0, 0), ins(F, 0, 0)],
        [ins(SA, 0, 0), ins(L, 1, 1), ins(F, 1, 1)],
        [ins(SA, 1, 1), ins(RG, 0, 0), ins(B, 0, 0)],
        [ins(L, 2, 0), ins(F, 2, 0)],
        [ins(SA, 2, 0), ins(RG, 1, 1), ins(B, 1, 1)],
        [ins(RG, 2, 0), ins(B, 2, 0)],
        end,
    ]
    assert list(OneFOneBSchedule(3, 2, 1).steps()) == [
        [ins(RA, 0, 0), ins(L, 0, 0), ins(F, 0, 0)],
        [ins(B, 0, 0)],
        [ins(SG, 0, 0), ins(RA, 1, 0), ins(L, 1, 0), ins(F, 1, 0)],
        [ins(B, 1, 0)],
        [ins(SG, 1, 0), ins(RA, 2, 0), ins(L, 2, 0), ins(F, 2, 0)],
        [ins(B, 2, 0)],
        [ins(SG, 2, 0), *end],
    ]


def test_inference_forwards_only() -> None:
    """Forwards only, each (micro-batch, chunk) once, any m even with chunks; one slot suffices (freed at its send);
    no backward, gradient traffic, reduce or step."""
    for p in range(1, 9):
        for m in range(1, 17, 3):
            for v in (1, 2, 3) if p > 1 else (1,):
                for sched in _all_stages("1f1b", p, m, v, train=False):
                    flat = _flat(sched)
                    assert not any(isinstance(i, (BackwardPass, SendGrad, RecvGrad, *STEP_END)) for i in flat)
                    forwards = sorted((i.micro_batch, i.chunk) for i in flat if isinstance(i, ForwardPass))
                    assert forwards == [(mb, c) for mb in range(m) for c in range(v)]
                    assert sched.num_pipe_buffers() == 1


class _ReversedConsumer(InferenceSchedule):
    """Stage 1 consumes micro-batches in reverse while stage 0 sends them in order: a consistent order that a
    receive-just-in-time plan would break on the FIFO link."""

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        order = super().compute_order(stage_id)
        return order[::-1] if stage_id == 1 else order


def test_plan_receives_in_the_peers_send_order() -> None:
    """[Note: where communication goes]: before its first forward (micro-batch 2) stage 1 receives 0 and 1 too,
    in stage 0's send order, into their own slots; the simulator's FIFO check passes."""
    steps = list(_ReversedConsumer(3, 2, 1).steps())
    assert steps[0] == [
        RecvActivation(micro_batch=0, chunk=0, buffer=0),
        RecvActivation(micro_batch=1, chunk=0, buffer=1),
        RecvActivation(micro_batch=2, chunk=0, buffer=2),
        LoadMicroBatch(micro_batch=2, chunk=0, buffer=2),
        ForwardPass(micro_batch=2, chunk=0, buffer=2),
    ]
    result = simulate([_ReversedConsumer(3, 2, s) for s in range(2)])
    assert result.peak_buffers == (1, 3)
