"""The executor's activation slots: one per (chunk, buffer) of the schedule, and the count of live ones.

A slot holds one micro-batch's state on one model chunk between its ``ForwardPass`` and its ``BackwardPass``: the
inputs forward consumed (received leaves, whose ``.grad`` ``SendGrad`` sends back), the outputs backward starts
from, the labels and the loss on the last virtual stage, and the output gradients received. The schedule reuses a
slot once its backward freed it ([Note: pipeline instructions] in instructions.py); using a slot that is still
taken is a schedule bug, raised here naming both micro-batches rather than silently overwriting activations.

``live`` counts micro-batches whose forward ran and whose backward has not yet (their activations are held):
the figure 1F1B bounds by the number of stages, and the one ``PipeStepStats.peak_buffers`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MicroSlot", "PipeBuffers", "PipeStepStats"]


@dataclass
class MicroSlot:
    micro_batch: int
    inputs: tuple[torch.Tensor, ...] | None = None
    """Forward's inputs: loaded (first virtual stage) or received (detached leaves, grad as the sender's)."""
    single_input: bool = True
    """The inputs were one tensor, not a tuple: the module is called with the tensor (DeepSpeed's convention)."""
    labels: Any = None
    """Last virtual stage only: the micro-batch's labels."""
    outputs: tuple[torch.Tensor, ...] | None = None
    loss: torch.Tensor | None = None
    """Last virtual stage: ``loss_fn(outputs, labels)`` (or the output itself without a loss function)."""
    output_grads: tuple[torch.Tensor, ...] | None = None
    """Received gradients of the outputs that require grad, in output order."""
    forwarded: bool = False


@dataclass
class PipeStepStats:
    """What one ``train_batch`` (``engine.pipe_stats``) / ``eval_batch`` (``engine.eval_pipe_stats``) spent where
    on this rank.

    ``wait_s`` is the time blocked in receives and send completions (the pipeline bubble as this rank saw it, plus
    transfer time); ``post_s`` the time posting p2p operations; ``compute_s`` forward + backward (loss included),
    which is not pure compute: it includes what the ZeRO stage communicates inside them over the data axis —
    ZeRO-3's parameter all-gathers (forward and backward), and with ``zero_hold: "micro_batch"`` the per-micro-batch
    gradient reductions (in ``backward_s``); under the step-scoped hold the one reduction is in ``step_s``;
    ``step_s`` the reductions and the optimizer step; ``messages`` / ``bytes`` this rank's p2p traffic, sent and
    received (``PipeChannel.stats``). ``peak_buffers`` is the most micro-batches whose activations were held at
    once (forward done, backward not yet)."""

    wait_s: float = 0.0
    post_s: float = 0.0
    compute_s: float = 0.0
    peak_buffers: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0
    total_s: float = 0.0
    messages: int = 0
    bytes: int = 0
    gather_s: float = 0.0
    """Partitioned messages' all-gathers over the tensor axis (``pipe_partitioned``), apart from ``wait_s``."""
    micro_batches: int = 0
    forwards: int = 0
    backwards: int = 0

    @property
    def idle_fraction(self) -> float:
        """``wait_s`` over the batch's wall time: this rank's measured bubble (p2p transfer time included)."""
        return self.wait_s / self.total_s if self.total_s > 0 else 0.0


@dataclass
class PipeBuffers:
    slots: dict[tuple[int, int], MicroSlot] = field(default_factory=dict)
    live: int = 0
    peak: int = 0

    def claim(self, chunk: int, buffer: int, micro_batch: int) -> MicroSlot:
        """The slot for ``micro_batch`` (created on its first instruction)."""
        slot = self.slots.get((chunk, buffer))
        if slot is None:
            slot = self.slots[(chunk, buffer)] = MicroSlot(micro_batch)
        elif slot.micro_batch != micro_batch:
            raise RuntimeError(
                f"pipeline schedule error: buffer {buffer} of chunk {chunk} still holds micro-batch "
                f"{slot.micro_batch} when micro-batch {micro_batch} needs it"
            )
        return slot

    def get(self, chunk: int, buffer: int, micro_batch: int, what: str) -> MicroSlot:
        slot = self.slots.get((chunk, buffer))
        if slot is None or slot.micro_batch != micro_batch:
            held = "nothing" if slot is None else f"micro-batch {slot.micro_batch}"
            raise RuntimeError(
                f"pipeline schedule error: {what} of micro-batch {micro_batch} on chunk {chunk} finds buffer "
                f"{buffer} holding {held}"
            )
        return slot

    def mark_forwarded(self, slot: MicroSlot) -> None:
        slot.forwarded = True
        self.live += 1
        self.peak = max(self.peak, self.live)

    def free(self, chunk: int, buffer: int) -> None:
        slot = self.slots.pop((chunk, buffer), None)
        if slot is not None and slot.forwarded:
            self.live -= 1

    def clear(self) -> None:
        self.slots.clear()
        self.live = self.peak = 0
