"""The instructions a pipeline schedule emits, and where a virtual stage's neighbours are.

[Note: pipeline instructions] A schedule (``schedule.py``) is a pure generator: for one stage it yields, step by
step, lists of these instructions; the executor (``executor.py``) interprets them with p2p sends/receives and
autograd. Nothing here touches a process group, so schedules are unit-tested for deadlock freedom, buffer counts
and step counts with no process at all (``simulate.py``).

Addressing: ``micro_batch`` is the micro-batch index within one ``train_batch`` (0-based); ``chunk`` is the local
model chunk (0 without interleaving; with ``chunks`` = v virtual stages per rank, rank ``s`` holds model chunks
``c`` = 0..v-1, which are *virtual* stages ``c·p + s`` of the ``p·v``-deep pipeline, Megatron's interleaving);
``buffer`` is the activation slot the micro-batch's input/output live in (slots are reused; a schedule's
``num_pipe_buffers()`` bounds them). Step-level instructions (reduce, step) carry no micro-batch (-1).

Semantics the executor honours and the simulator checks:
- a send never blocks (it is posted and completes later); a receive blocks until its message arrived;
- messages on one directed link (stage a → stage b) arrive in the order they were sent, *whatever their kind*
  (activations and gradients share a link under interleaving; NCCL ignores tags), so a schedule must receive on
  each link in the order its peer sends on it;
- ``ForwardPass`` consumes the buffer's input (received, or loaded on the first virtual stage) and keeps what
  backward needs; ``BackwardPass`` consumes the buffer's output gradient (received, or the loss on the last
  virtual stage) and frees the activations; the slot itself is free after its last reader, ``SendGrad`` (the
  input's gradient) — or the ``BackwardPass`` on the first virtual stage; in inference ``SendActivation`` or the
  last virtual stage's ``ForwardPass`` ([Note: pipeline buffer slots] in schedule.py);
- ``ReduceTiedGrads`` → ``ReduceGrads`` → ``OptimizerStep`` end a training schedule, in that order, once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BackwardPass",
    "ForwardPass",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "next_virtual",
    "prev_virtual",
]


@dataclass(frozen=True, kw_only=True)
class PipeInstruction:
    micro_batch: int = -1
    chunk: int = 0
    buffer: int = -1

    def __repr__(self) -> str:
        if self.micro_batch < 0:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}(mb={self.micro_batch}, chunk={self.chunk}, buf={self.buffer})"


@dataclass(frozen=True, kw_only=True, repr=False)
class LoadMicroBatch(PipeInstruction):
    """Read micro-batch ``micro_batch`` from the data iterator into ``buffer``: inputs on the first virtual stage,
    labels on the last (a stage that is both reads both from one batch)."""


@dataclass(frozen=True, kw_only=True, repr=False)
class ForwardPass(PipeInstruction):
    """Run the chunk's layers on the buffer's input; on the last virtual stage also the loss."""


@dataclass(frozen=True, kw_only=True, repr=False)
class BackwardPass(PipeInstruction):
    """Backpropagate the buffer's output gradient (the scaled loss on the last virtual stage); frees the buffer."""


@dataclass(frozen=True, kw_only=True, repr=False)
class SendActivation(PipeInstruction):
    """Send the buffer's output to the next virtual stage."""


@dataclass(frozen=True, kw_only=True, repr=False)
class RecvActivation(PipeInstruction):
    """Receive the buffer's input from the previous virtual stage."""


@dataclass(frozen=True, kw_only=True, repr=False)
class SendGrad(PipeInstruction):
    """Send the gradient of the buffer's input to the previous virtual stage."""


@dataclass(frozen=True, kw_only=True, repr=False)
class RecvGrad(PipeInstruction):
    """Receive the gradient of the buffer's output from the next virtual stage."""


@dataclass(frozen=True, kw_only=True, repr=False)
class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of weights tied across stages over the stages holding them."""


@dataclass(frozen=True, kw_only=True, repr=False)
class ReduceGrads(PipeInstruction):
    """Reduce the step's accumulated gradients over the data axis (the ZeRO stage's reduction)."""


@dataclass(frozen=True, kw_only=True, repr=False)
class OptimizerStep(PipeInstruction):
    """The step core: norm → overflow → clip → step, agreed world-wide."""


def next_virtual(stage: int, chunk: int, stages: int, chunks: int = 1) -> tuple[int, int] | None:
    """(stage, chunk) of the virtual stage after ``chunk`` on ``stage``; None past the last one."""
    v = chunk * stages + stage + 1
    return None if v >= stages * chunks else (v % stages, v // stages)


def prev_virtual(stage: int, chunk: int, stages: int, chunks: int = 1) -> tuple[int, int] | None:
    """(stage, chunk) of the virtual stage before ``chunk`` on ``stage``; None before the first one."""
    v = chunk * stages + stage - 1
    return None if v < 0 else (v % stages, v // stages)
