"""``HostGradients``: host copies of the offloaded optimizer's device gradients, taken per bucket as each is final.

ZeRO-Offload steps on the CPU, so every gradient shard crosses to the host once per step. Copying them all when
the step starts would put that transfer on the critical path; instead the stage reports each bucket (ZeRO-1/2)
or unit (ZeRO-3) as soon as its reduced gradient of the last micro-step is in place (``on_final``), and its copy
starts at once on a side stream into pinned memory, overlapping the rest of backward. The step then ``take``s
each tensor's host copy, waiting only for that copy.

Scaling after the copy (gradient clipping, fp16 unscaling) is recorded as a factor (``scale_``) and applied to
each host chunk as the step reads it, rather than copying again. A tensor the stage never reported (not expected,
but not worth a wrong step) is copied synchronously when taken and counted in ``late_copies``.

Host memory: one fp32 copy of this rank's offloaded gradient shards, pinned (4Ψ/N bytes, DeepSpeed's CPU gradient
partition too; whole stepped tensors, including chunks ``ratio`` keeps on the device).

On a machine without an accelerator the gradients already live in host memory and nothing is copied (the engine
does not create this); tests force it on the CPU to check the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostGradients:
    """Host (pinned, with an accelerator) copies of ``tensors``' ``.grad``, one buffer per stepped tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor], pin: bool) -> None:
        self._pin = pin
        self._host = {id(t): torch.empty(t.numel(), dtype=torch.float32, pin_memory=pin) for t in tensors}
        accelerated = any(t.device.type == "cuda" for t in tensors)
        self._stream = torch.cuda.Stream() if accelerated else None
        self._copied: dict[int, torch.cuda.Event | None] = {}  # tensor id → copy done event (None: synchronous)
        self.scale = 1.0
        self.staged = 0  # tensors copied when the stage reported them (this step)
        self.late_copies = 0  # tensors copied only when the step asked for them (this step)
        self.last_step: tuple[int, int] = (0, 0)  # (staged, late_copies) of the last step consumed

    def rebind(self, tensors: Sequence[torch.Tensor]) -> None:
        """The stepped tensors were replaced (the bucket re-layout before the first step, zero/arrival_order.py):
        host buffers for the new ones, the old freed first (so the peak stays one copy, not two)."""
        assert not self._copied, "re-layout with host copies outstanding"
        self._host.clear()
        self._host = {id(t): torch.empty(t.numel(), dtype=torch.float32, pin_memory=self._pin) for t in tensors}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host.values())

    @torch.no_grad()
    def stage(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start copying ``tensors``' (final, reduced) gradients to the host."""
        for tensor in tensors:
            host = self._host.get(id(tensor))
            if host is None:  # not a tensor this optimizer offloads (kept on the device by ratio)
                continue
            grad = tensor.grad.view(-1)
            if self._stream is None:
                host.copy_(grad)
                self._copied[id(tensor)] = None
            else:
                self._stream.wait_stream(torch.cuda.current_stream(grad.device))  # the reduction wrote it there
                with torch.cuda.stream(self._stream):
                    host.copy_(grad, non_blocking=True)
                    grad.record_stream(self._stream)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                self._copied[id(tensor)] = event
            self.staged += 1

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s gradient on the host (its copy waited for, or made now); scale not yet applied."""
        key = id(tensor)
        if key not in self._copied:
            self._host[key].copy_(tensor.grad.view(-1))
            self._copied[key] = None
            self.late_copies += 1
        event = self._copied[key]
        if event is not None:
            event.synchronize()
        return self._host[key]

    def scale_(self, factor: float) -> None:
        """Gradients were to be multiplied by ``factor`` after their copy: the step applies it per chunk."""
        self.scale *= factor

    def forget(self) -> None:
        """The step consumed (or skipped) this step's copies: the next step starts with none."""
        self._copied.clear()
        if self.staged or self.late_copies:  # a second forget (start of the next backward) keeps the record
            self.last_step = (self.staged, self.late_copies)
        self.scale, self.staged, self.late_copies = 1.0, 0, 0
