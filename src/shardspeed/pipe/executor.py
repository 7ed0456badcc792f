"""The interpreter of pipeline schedules: instructions (``instructions.py``) → p2p, forward, autograd.

[Note: pipeline executor] A schedule yields, for this stage, lists of instructions step by step; the executor
runs them in order with the semantics of [Note: pipeline instructions]: a send is posted and never waited for
here (``PipeChannel.wait_sends`` at the end of the batch), a receive blocks. Consecutive send/receive
instructions of one step are posted together (``PipeChannel.exchange``: one ``batch_isend_irecv``), so a step
such as "send my activation, receive the next gradient" never waits on the order both sides happened to list
them in; per link the order of messages is the schedule's, which is what the channel matches them by.

What the compute instructions do:
- ``LoadMicroBatch``: the first virtual stage takes the batch's inputs, the last its labels (``data.py``);
- ``ForwardPass``: ``module(inputs, chunk=c)`` (a 1-tuple is passed as its tensor, as DeepSpeed's engine does);
  received inputs are fresh leaves whose ``requires_grad`` the sender negotiated, so their ``.grad`` is what
  ``SendGrad`` returns; on the last virtual stage also ``loss_fn(outputs, labels)`` (no loss_fn: the output is
  the loss). Outputs are kept for backward;
- ``BackwardPass``: ``autograd.backward`` of the outputs that require grad with the received gradients, or of the
  loss × loss_scale / m on the last virtual stage (the mean over micro-batches; fp16's loss scale). The driver
  wraps it in the stage's reducer protocol (``StepHooks.backward``), told whether it is this rank's last backward
  (``final``) and the micro-batch's last chunk backward on this rank (``last_of_micro_batch``: with v chunks a
  micro-batch has v backwards here; per-micro-batch reduction communicates only in its last). The inputs'
  gradients are kept by micro-batch (not by buffer: the schedule may reuse the buffer before ``SendGrad``
  runs); an input that required grad but got none (unused downstream) sends zeros, so the peer's backward gets
  every tensor it waits for;
- ``ReduceTiedGrads`` / ``ReduceGrads`` / ``OptimizerStep``: the driver's (``training/pipe_driver.py``).

Nothing here decides *whether* gradients are communicated or *when* the optimizer steps; it only executes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardspeed.pipe.buffers import PipeBuffers, PipeStepStats
from shardspeed.pipe.data import StageData, as_tuple
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

__all__ = ["ExecResult", "PipeExecutor", "StepHooks"]

_COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)


class StepHooks(Protocol):
    """What a training schedule's executor asks the loop driver to do (``training/pipe_driver.py``)."""

    def backward(self, run: Callable[[], None], final: bool, last_of_micro_batch: bool = True) -> None:
        """Run ``run`` (the autograd call) inside the stage's reducer protocol; ``final``: this rank's last;
        ``last_of_micro_batch``: the micro-batch's last chunk backward on this rank ([Note: one reduction per
        micro-batch] in training/pipe_driver.py)."""
        ...

    def reduce_tied_grads(self) -> None: ...

    def reduce_grads(self) -> None: ...

    def optimizer_step(self, losses: Sequence[torch.Tensor]) -> None:
        """``losses``: this batch's per-micro-batch losses on the last virtual stage (empty elsewhere)."""
        ...


@dataclass
class ExecResult:
    losses: list[torch.Tensor] = field(default_factory=list)
    """Last virtual stage: each micro-batch's loss (detached), in micro-batch order."""
    outputs: list[Any] = field(default_factory=list)
    """Last virtual stage, when asked for: each micro-batch's model output (detached)."""
    stats: PipeStepStats = field(default_factory=PipeStepStats)


class PipeExecutor:
    """Runs one stage's schedule. ``module(inputs, chunk=c)`` runs local chunk ``c``; ``channel`` is the
    ``PipeChannel`` (S3); ``pipe_ranks[s]`` the global rank of pipeline stage ``s`` in this rank's pipeline."""

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        channel: Any,
        pipe_ranks: Sequence[int],
        stage_id: int,
        chunks: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        events: Any = None,
    ) -> None:
        self.module = module
        self.channel = channel
        self.pipe_ranks = tuple(pipe_ranks)
        self.stages = len(self.pipe_ranks)
        self.stage_id = stage_id
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.events = events
        self.buffers = PipeBuffers()

    # --- addressing ------------------------------------------------------------------------------------------------
    def virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.stage_id

    def is_first_virtual(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last_virtual(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.stages * self.chunks - 1

    def _next_peer(self, chunk: int) -> int:
        """Global rank of the next virtual stage's rank (same data and tensor index)."""
        nxt = next_virtual(self.stage_id, chunk, self.stages, self.chunks)
        if nxt is None:
            raise RuntimeError(f"pipeline schedule error: stage {self.stage_id} chunk {chunk} is the last one")
        return self.pipe_ranks[nxt[0]]

    def _prev_peer(self, chunk: int) -> int:
        prev = prev_virtual(self.stage_id, chunk, self.stages, self.chunks)
        if prev is None:
            raise RuntimeError(f"pipeline schedule error: stage {self.stage_id} chunk {chunk} is the first one")
        return self.pipe_ranks[prev[0]]

    # --- the run --------------------------------------------------------------------------------------------------
    def run(
        self,
        steps: Iterable[list[PipeInstruction]],
        data: StageData,
        *,
        micro_batches: int,
        hooks: StepHooks | None = None,
        loss_scale: float = 1.0,
        compute_loss: bool = True,
        keep_outputs: bool = False,
    ) -> ExecResult:
        """Execute a schedule. ``hooks`` is None for inference (a schedule without backward or step)."""
        self.buffers.clear()
        self._data, self._hooks, self._m = data, hooks, micro_batches
        self._loss_scale, self._compute_loss, self._keep_outputs = loss_scale, compute_loss, keep_outputs
        self._train = hooks is not None
        # Training and inference negotiate their own streams: the same activations require grad in one and not
        # in the other, and a stream's negotiated metas include that (pipe/p2p.py).
        self._kind = "" if self._train else "eval."
        self._input_grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, Any] = {}
        self._backwards_left = micro_batches * self.chunks
        self._chunk_backwards: dict[int, int] = {}  # micro-batch → its chunk backwards run on this rank so far
        stats = PipeStepStats(micro_batches=micro_batches)
        self._stats = stats
        before = self._channel_stats()
        start = time.perf_counter()
        try:
            for step in steps:
                self._run_step(step)
            # Not on the error path: a peer that stopped may never receive them, and this rank's failure is
            # published (faults/guard.py) only once the error leaves the engine call.
            self.channel.wait_sends()
        finally:
            after = self._channel_stats()
            stats.total_s = time.perf_counter() - start
            stats.wait_s, stats.post_s = after[0] - before[0], after[1] - before[1]
            stats.messages, stats.bytes = int(after[2] - before[2]), int(after[3] - before[3])
            stats.gather_s = after[4] - before[4]
            stats.peak_buffers = self.buffers.peak
            stats.compute_s = stats.forward_s + stats.backward_s
            self.buffers.clear()
        return ExecResult(
            losses=[self._losses[i] for i in sorted(self._losses)],
            outputs=[self._outputs[i] for i in sorted(self._outputs)],
            stats=stats,
        )

    def _channel_stats(self) -> tuple[float, float, float, float, float]:
        s = getattr(self.channel, "stats", None)  # cumulative: the batch's figures are differences
        if s is None:
            return (0.0, 0.0, 0.0, 0.0, 0.0)
        return (float(s.wait_s), float(s.post_s), float(s.messages), float(s.bytes), float(getattr(s, "gather_s", 0)))

    def _run_step(self, step: list[PipeInstruction]) -> None:
        i = 0
        while i < len(step):
            if isinstance(step[i], _COMM):
                j = i
                while j < len(step) and isinstance(step[j], _COMM):
                    j += 1
                self._communicate(step[i:j])
                i = j
                continue
            self._compute(step[i])
            i += 1

    # --- communication --------------------------------------------------------------------------------------------
    def _communicate(self, run: list[PipeInstruction]) -> None:
        sends: list[tuple[tuple[torch.Tensor, ...], int, str]] = []
        recvs: list[tuple[int, str]] = []
        targets: list[PipeInstruction] = []
        for ins in run:
            if isinstance(ins, SendActivation):
                slot = self.buffers.get(ins.chunk, ins.buffer, ins.micro_batch, "SendActivation")
                if slot.outputs is None:
                    raise RuntimeError(f"pipeline schedule error: {ins!r} before its ForwardPass")
                # streams are named by the receiving virtual stage: both ends compute the same name
                sends.append(
                    (slot.outputs, self._next_peer(ins.chunk), f"{self._kind}act{self.virtual(ins.chunk) + 1}")
                )
                if not self._train:  # inference: nothing waits for this micro-batch's activations any more
                    self.buffers.free(ins.chunk, ins.buffer)
            elif isinstance(ins, SendGrad):
                grads = self._input_grads.pop((ins.chunk, ins.micro_batch), None)
                if grads is None:
                    raise RuntimeError(f"pipeline schedule error: {ins!r} before its BackwardPass")
                sends.append((grads, self._prev_peer(ins.chunk), f"grad{self.virtual(ins.chunk) - 1}"))
            elif isinstance(ins, RecvActivation):
                recvs.append((self._prev_peer(ins.chunk), f"{self._kind}act{self.virtual(ins.chunk)}"))
                targets.append(ins)
            else:
                assert isinstance(ins, RecvGrad)
                recvs.append((self._next_peer(ins.chunk), f"grad{self.virtual(ins.chunk)}"))
                targets.append(ins)
        if len(sends) == 1 and not recvs:
            tensors, peer, stream = sends[0]
            self.channel.send(tensors, peer, stream)
            return
        received = self.channel.exchange(sends, recvs) if (sends or recvs) else []
        for ins, tensors in zip(targets, received):
            if isinstance(ins, RecvActivation):
                slot = self.buffers.claim(ins.chunk, ins.buffer, ins.micro_batch)
                slot.inputs, slot.single_input = tuple(tensors), len(tensors) == 1
            else:
                slot = self.buffers.get(ins.chunk, ins.buffer, ins.micro_batch, "RecvGrad")
                slot.output_grads = tuple(tensors)

    # --- compute --------------------------------------------------------------------------------------------------
    def _compute(self, ins: PipeInstruction) -> None:
        if isinstance(ins, LoadMicroBatch):
            self._load(ins)
        elif isinstance(ins, ForwardPass):
            self._timed("forward", self._forward, ins)
        elif isinstance(ins, BackwardPass):
            self._timed("backward", self._backward, ins)
        elif isinstance(ins, (ReduceTiedGrads, ReduceGrads, OptimizerStep)):
            hooks = self._hooks
            if hooks is None:
                raise RuntimeError(f"{ins!r} in an inference schedule")
            start = time.perf_counter()
            if isinstance(ins, (ReduceTiedGrads, ReduceGrads)):
                # the gradient reductions, timed as backward_allreduce ([Note: backward split] in timers.py)
                with self.events.phase("reduce") if self.events is not None else _nothing():
                    if isinstance(ins, ReduceTiedGrads):
                        hooks.reduce_tied_grads()
                    else:
                        hooks.reduce_grads()
            else:
                hooks.optimizer_step([self._losses[i] for i in sorted(self._losses)])
            self._stats.step_s += time.perf_counter() - start
        else:
            raise TypeError(f"unknown pipeline instruction {ins!r}")

    def _timed(self, phase: str, fn: Callable[[PipeInstruction], None], ins: PipeInstruction) -> None:
        start = time.perf_counter()
        fn(ins)
        elapsed = time.perf_counter() - start
        if phase == "forward":
            self._stats.forward_s += elapsed
            self._stats.forwards += 1
        else:
            self._stats.backward_s += elapsed
            self._stats.backwards += 1

    def _load(self, ins: LoadMicroBatch) -> None:
        first, last = self.is_first_virtual(ins.chunk), self.is_last_virtual(ins.chunk)
        if not (first or last):
            raise RuntimeError(f"pipeline schedule error: {ins!r} on a middle stage (stage {self.stage_id})")
        inputs, labels = self._data.load(ins.micro_batch)
        slot = self.buffers.claim(ins.chunk, ins.buffer, ins.micro_batch)
        if first:
            slot.inputs, slot.single_input = as_tuple(inputs, "the batch's inputs")
        if last:
            slot.labels = labels

    def _forward(self, ins: ForwardPass) -> None:
        slot = self.buffers.get(ins.chunk, ins.buffer, ins.micro_batch, "ForwardPass")
        if slot.inputs is None:
            raise RuntimeError(f"pipeline schedule error: {ins!r} before its inputs were loaded or received")
        x = slot.inputs[0] if slot.single_input else slot.inputs
        if self.events is not None and self.is_first_virtual(ins.chunk):
            self.events.inputs((x,), {})  # the batch's inputs: the monitors' tokens per sample
        phase = self.events.phase("forward") if self.events is not None else _nothing()
        with phase:
            out = self.module(x, chunk=ins.chunk)
            if self.is_last_virtual(ins.chunk):
                if self._keep_outputs:
                    self._outputs[ins.micro_batch] = _detached(out)
                if self._compute_loss or self._train:
                    slot.loss = self._loss(out, slot.labels)
                    self._losses[ins.micro_batch] = slot.loss.detach()
                if not self._train:
                    self.buffers.free(ins.chunk, ins.buffer)
                    return
                slot.labels = None  # backward starts from the loss
            else:
                slot.outputs, _ = as_tuple(out, f"the output of pipeline stage {self.stage_id} chunk {ins.chunk}")
        if self._train:
            self.buffers.mark_forwarded(slot)

    def _loss(self, out: Any, labels: Any) -> torch.Tensor:
        loss = self.loss_fn(out, labels) if self.loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = "loss_fn(outputs, labels)" if self.loss_fn is not None else "the last stage's output (no loss_fn)"
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"{what} must be a scalar tensor (the micro-batch's loss), got {shape}")
        return loss

    def _backward(self, ins: BackwardPass) -> None:
        hooks = self._hooks
        if hooks is None:
            raise RuntimeError(f"{ins!r} in an inference schedule")
        slot = self.buffers.get(ins.chunk, ins.buffer, ins.micro_batch, "BackwardPass")
        if not slot.forwarded:
            raise RuntimeError(f"pipeline schedule error: {ins!r} without its ForwardPass")
        if slot.loss is not None:  # the last virtual stage
            tensors: list[torch.Tensor] = [slot.loss.float() * (self._loss_scale / self._m)]
            grads: list[torch.Tensor | None] = [None]
        else:
            assert slot.outputs is not None
            tensors = [o for o in slot.outputs if o.requires_grad]
            received = slot.output_grads
            if received is None:
                raise RuntimeError(f"pipeline schedule error: {ins!r} before its RecvGrad")
            if len(received) != len(tensors):
                raise RuntimeError(
                    f"stage {self.stage_id} chunk {ins.chunk}: received {len(received)} output gradient(s) for "
                    f"{len(tensors)} output(s) requiring grad (micro-batch {ins.micro_batch})"
                )
            grads = list(received)
        self._backwards_left -= 1
        done = self._chunk_backwards.get(ins.micro_batch, 0) + 1
        self._chunk_backwards[ins.micro_batch] = done
        final, last_of_mb = self._backwards_left == 0, done == self.chunks

        def run() -> None:  # nothing downstream needing a gradient from this chunk: the protocol still runs
            if tensors:
                torch.autograd.backward(tensors, grad_tensors=grads)

        phase = self.events.phase("backward") if self.events is not None else _nothing()
        with phase:
            hooks.backward(run, final, last_of_micro_batch=last_of_mb)
        if not self.is_first_virtual(ins.chunk):
            assert slot.inputs is not None
            self._input_grads[(ins.chunk, ins.micro_batch)] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t) for t in slot.inputs if t.requires_grad
            )
        self.buffers.free(ins.chunk, ins.buffer)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out
