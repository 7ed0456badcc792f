"""The schedule simulator (pipe/simulate.py): every built-in schedule over many (stages, micro-batches, chunks) is
deadlock-free, FIFO per link, forwards/backwards each micro-batch once per virtual stage, and reproduces the
bubble's closed form exactly; broken schedules are caught with the stage and instruction named."""

from __future__ import annotations

from fractions import Fraction

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
from shardspeed.pipe.schedule import ComputeOp, InterleavedSchedule, PipeSchedule, build_schedule
from shardspeed.pipe.simulate import (
    ScheduleError,
    bubble_formula,
    bubble_formula_exact,
    format_timeline,
    simulate,
)


def _run(name: str, p: int, m: int, v: int = 1, *, train: bool = True, **costs: float):
    return simulate([build_schedule(name, m, p, s, v, train=train) for s in range(p)], **costs)


def _counts(result, p: int, m: int, v: int) -> None:
    """Every (micro-batch, chunk) forwarded and backwarded exactly once on every stage, by the timeline."""
    for lane in result.timeline:
        for kind in (ForwardPass, BackwardPass):
            done = sorted(
                (sl.instruction.micro_batch, sl.instruction.chunk) for sl in lane if isinstance(sl.instruction, kind)
            )
            assert done == [(mb, c) for mb in range(m) for c in range(v)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flat_schedules_exact_bubble_and_buffers(name: str) -> None:
    """p = 1..8, m = 1..16, unit costs (b = 2f): the bubble is exactly (p − 1)/(m + p − 1), the makespan
    (m + p − 1)·3; live buffers peak at min(p − s, m) ≤ p under 1F1B and m under GPipe (counted by the
    simulator's slot tracking)."""
    for p in range(1, 9):
        for m in range(1, 17):
            result = _run(name, p, m)
            assert result.bubble_fraction == bubble_formula_exact(name, p, m) == Fraction(p - 1, m + p - 1)
            assert result.makespan == 3 * (m + p - 1)
            assert result.busy == (3 * m,) * p
            assert result.steps == (2 * m + 1,) * p
            if name == "1f1b":
                assert result.peak_buffers == tuple(min(p - s, m) for s in range(p))
                assert max(result.peak_buffers) <= p
            else:
                assert result.peak_buffers == (m,) * p
            _counts(result, p, m, 1)


def test_interleaved_exact_bubble() -> None:
    """p = 2..8, m = p..16 (multiples of p), v = 2..4, chunk costs f/v and b/v: exactly Megatron's
    (p − 1)/(v·m + p − 1) ([Note: the interleaved bubble]); live chunk activations peak at
    min(2·(p − s − 1) + (v − 1)·p + 1, m·v)."""
    for p in range(2, 9):
        for m in range(p, 17, p):
            for v in (2, 3, 4):
                result = _run("interleaved", p, m, v)
                assert result.bubble_fraction == bubble_formula_exact("interleaved", p, m, v)
                assert result.bubble_fraction == Fraction(p - 1, v * m + p - 1)
                assert result.makespan == 3 * m + Fraction(3 * (p - 1), v)
                assert result.peak_buffers == tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))
                assert result.steps == (2 * m * v + 1,) * p
                _counts(result, p, m, v)


class _LeanWarmup(InterleavedSchedule):
    """Interleaving with (p − s − 1) + (v − 1)·p warm-up forwards instead of Megatron's 2·(p − s − 1) + …"""

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        order = super().compute_order(stage_id)
        p, v, m = self.stages, self.chunks, self.micro_batches
        lean = min((p - stage_id - 1) + (v - 1) * p, m * v)
        forwards = [op for op in order if op.forward]
        backwards = [op for op in order if not op.forward]
        steady = [op for k in range(m * v - lean) for op in (forwards[lean + k], backwards[k])]
        return forwards[:lean] + steady + backwards[m * v - lean :]


def test_interleaved_warmup_hides_p2p_latency() -> None:
    """[Note: the interleaved bubble]: with a p2p latency c up to one chunk's forward, Megatron's order finishes in
    3m + 3(p − 1)/v + 2(p·v − 1)·c exactly; a leaner warm-up has the same bubble at c = 0 (and fewer buffers) but
    stalls once c > 0."""
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p):
            for v in (2, 3, 4):
                for c in (Fraction(1, 2 * v), Fraction(1, v)):
                    result = _run("interleaved", p, m, v, p2p_cost=c)
                    assert result.makespan == 3 * m + Fraction(3 * (p - 1), v) + 2 * (p * v - 1) * c
    lean = [_LeanWarmup(8, 4, s, 2) for s in range(4)]
    assert simulate(lean).bubble_fraction == _run("interleaved", 4, 8, 2).bubble_fraction
    assert simulate(lean).peak_buffers == (8, 7, 6, 5)
    assert _run("interleaved", 4, 8, 2).peak_buffers == (11, 9, 7, 5)
    assert simulate(lean, p2p_cost=0.5).makespan == Fraction(87, 2)
    assert _run("interleaved", 4, 8, 2, p2p_cost=0.5).makespan == Fraction(71, 2)


def test_interleaving_beats_1f1b() -> None:
    for p, m in ((2, 4), (4, 8), (8, 16)):
        assert _run("interleaved", p, m, 2).bubble_fraction < _run("1f1b", p, m).bubble_fraction


def test_inference_runs_and_times() -> None:
    """Forwards only, any m (also with chunks): no deadlock or FIFO break; without chunks the makespan is
    (m + p − 1)·f."""
    for p in range(1, 9):
        for m in range(1, 17):
            assert _run("1f1b", p, m, train=False).makespan == m + p - 1
            for v in (2, 3) if p > 1 and m in (1, 2, 3, 5, 7, 8, 13, 16) else ():
                result = _run("interleaved", p, m, v, train=False)
                assert result.busy == (m,) * p and result.peak_buffers == (1,) * p


def test_costs_and_p2p_latency() -> None:
    """Costs scale the makespan; a p2p latency c adds 2c per stage boundary on one micro-batch's round trip."""
    assert _run("1f1b", 2, 1, p2p_cost=0.5).makespan == 2 * (1 + 2) + 2 * Fraction(1, 2)
    assert _run("gpipe", 3, 1, forward_cost=1, backward_cost=1).makespan == 6
    result = _run("1f1b", 4, 8, forward_cost=1, backward_cost=1)
    assert result.bubble_fraction == Fraction(3, 11)
    assert bubble_formula("1f1b", 4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'"):
        bubble_formula("pipedream", 4, 8)


def test_format_timeline() -> None:
    text = format_timeline(_run("1f1b", 2, 2))
    assert text.splitlines() == [
        "tick = 1, makespan = 9, bubble = 1/3",
        "stage 0: F0 F1 .. .. B0 B0 .. B1 B1",
        "stage 1: .. F0 B0 B0 F1 B1 B1 .. ..",
    ]
    assert "F1:1" in format_timeline(_run("interleaved", 2, 2, 2))


# ---- broken schedules: the error names the stage, the step and the instruction ----


class _Literal(PipeSchedule):
    """A schedule given as literal steps per stage (for breaking things on purpose)."""

    def __init__(self, program: list[list[list[PipeInstruction]]], stage_id: int, m: int, buffers: int = 4) -> None:
        super().__init__(m, len(program), stage_id)
        self._program, self._buffers = program, buffers

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        return []

    def steps(self):
        yield from (list(step) for step in self._program[self.stage_id])

    def num_pipe_buffers(self) -> int:
        return self._buffers


def _sim(program: list[list[list[PipeInstruction]]], m: int = 1, buffers: int = 4):
    return simulate([_Literal(program, s, m, buffers) for s in range(len(program))])


def _i(kind: type[PipeInstruction], mb: int = 0, buf: int | None = None) -> PipeInstruction:
    return kind(micro_batch=mb, chunk=0, buffer=mb if buf is None else buf)


END = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
STAGE0 = [[_i(LoadMicroBatch), _i(ForwardPass)], [_i(SendActivation), _i(RecvGrad), _i(BackwardPass)], END]
STAGE1 = [[_i(RecvActivation), _i(LoadMicroBatch), _i(ForwardPass)], [_i(BackwardPass)], [_i(SendGrad), *END]]


def test_literal_program_is_valid() -> None:
    assert _sim([STAGE0, STAGE1]).makespan == 6


def test_deadlock_is_named() -> None:
    """Stage 0 waits for the gradient before sending the activation that would produce it."""
    stage0 = [[_i(LoadMicroBatch), _i(ForwardPass)], [_i(RecvGrad), _i(SendActivation), _i(BackwardPass)], END]
    with pytest.raises(
        ScheduleError, match=r"deadlock.*stage 0, step 1, RecvGrad\(mb=0.*stage 1, step 0, RecvActivation"
    ):
        _sim([stage0, STAGE1])


def test_fifo_mismatch_is_named() -> None:
    """Stage 1 receives micro-batch 1 first while stage 0 sent 0 first on that link."""
    stage0 = [
        [_i(LoadMicroBatch, 0), _i(ForwardPass, 0)],
        [_i(SendActivation, 0), _i(LoadMicroBatch, 1), _i(ForwardPass, 1)],
        [_i(SendActivation, 1)],
    ]
    stage1 = [
        [_i(RecvActivation, 1), _i(LoadMicroBatch, 1), _i(ForwardPass, 1)],
        [_i(RecvActivation, 0), _i(LoadMicroBatch, 0), _i(ForwardPass, 0)],
    ]
    with pytest.raises(
        ScheduleError, match=r"stage 1, step 0, RecvActivation\(mb=1.*FIFO mismatch on link stage 0 -> stage 1"
    ):
        simulate([_Inference([stage0, stage1], s, 2) for s in range(2)])


class _Inference(_Literal):
    train = False


@pytest.mark.parametrize(
    ("stage0", "stage1", "match"),
    [
        (  # forward before the input arrived in the buffer
            [[_i(ForwardPass)], [_i(SendActivation), _i(RecvGrad), _i(BackwardPass)], END],
            STAGE1,
            r"stage 0, step 0, ForwardPass\(mb=0.*before it was filled",
        ),
        (  # backward on a stage that never ran the forward
            STAGE0,
            [[_i(RecvActivation), _i(LoadMicroBatch)], [_i(BackwardPass)], [_i(SendGrad), *END]],
            r"stage 1, step 1, BackwardPass\(mb=0.*a backward without its forward",
        ),
        (  # buffer index beyond num_pipe_buffers()
            [[_i(LoadMicroBatch, 0, 7), _i(ForwardPass, 0, 7)], *STAGE0[1:]],
            STAGE1,
            r"stage 0, step 0, LoadMicroBatch\(mb=0, chunk=0, buf=7\): buffer outside num_pipe_buffers\(\)=4",
        ),
        (  # the step-level instructions out of order
            STAGE0,
            [*STAGE1[:2], [_i(SendGrad), ReduceGrads(), ReduceTiedGrads(), OptimizerStep()]],
            r"stage 1, step 2, ReduceGrads\(\): step-level instructions must come once, in the order",
        ),
        (  # compute after the optimizer step
            [*STAGE0[:1], END, [_i(SendActivation), _i(RecvGrad), _i(BackwardPass)]],
            STAGE1,
            r"stage 0, step 2, SendActivation\(mb=0.*after OptimizerStep",
        ),
        (  # the batch never steps
            STAGE0[:2],
            STAGE1,
            r"stage 0: the schedule does not end with ReduceTiedGrads, ReduceGrads, OptimizerStep",
        ),
    ],
)
def test_broken_two_stage_programs(stage0, stage1, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        _sim([stage0, stage1])


def test_missing_and_duplicate_micro_batches() -> None:
    """m = 2 but micro-batch 1 never runs; or micro-batch 0 runs twice."""
    with pytest.raises(ScheduleError, match=r"stage 0: \(micro-batch, chunk\) \[\(1, 0\)\] never forwarded"):
        simulate([_Literal([[[_i(LoadMicroBatch), _i(ForwardPass)], [_i(BackwardPass)], END]], 0, 2)])
    twice = [[_i(LoadMicroBatch), _i(ForwardPass)], [_i(LoadMicroBatch, 0, 1), _i(ForwardPass, 0, 1)]]
    with pytest.raises(ScheduleError, match=r"stage 0, step 1, LoadMicroBatch\(mb=0.*loads micro-batch 0 twice"):
        simulate([_Literal([twice], 0, 1)])


def test_middle_stage_load_and_undelivered_message() -> None:
    mid = [[_i(RecvActivation), _i(LoadMicroBatch), _i(ForwardPass)]]
    head = [[_i(LoadMicroBatch), _i(ForwardPass)], [_i(SendActivation)]]
    tail = [[_i(RecvActivation), _i(LoadMicroBatch), _i(ForwardPass)]]
    with pytest.raises(ScheduleError, match=r"stage 1, step 0, LoadMicroBatch\(mb=0.*middle virtual stage 1"):
        simulate([_Inference([head, mid, tail], s, 1) for s in range(3)])
    sent_twice = [STAGE0[0], [_i(SendActivation), *STAGE0[1]], END]
    with pytest.raises(ScheduleError, match=r"link stage 0 -> stage 1: 1 message\(s\) never received"):
        _sim([sent_twice, STAGE1])


def test_mismatched_schedules_refused() -> None:
    with pytest.raises(ValueError, match=r"schedules\[1\].*does not match stage 1"):
        simulate([build_schedule("1f1b", 4, 2, 0), build_schedule("1f1b", 5, 2, 1)])
    with pytest.raises(ValueError, match=r"needs 3 schedules"):
        simulate([build_schedule("1f1b", 4, 3, s) for s in range(2)])
