"""Why a ZeRO-3 unit must stay gathered right now — one small record per unit, read by runtime.py.

[Note: unit lifetime] A gathered unit is released as soon as nothing below needs it; never on a guess about
what comes next. What needs a unit:

- ``forward_calls``: a forward call of its module (outside backward) that has not returned;
- ``backward_uses``: a forward call whose backward has begun (its outputs' mark fired) and not ended (its inputs'
  gradients are not all computed yet), see [Note: backward uses] in marks.py;
- ``unmarked_uses``: a backward use whose call had no input requiring grad (the first module, a block fed by a
  frozen embedding): nothing marks its end but its gradients, so it lasts until every expected gradient arrived;
- ``recompute_hold``: the module was re-run during backward (activation checkpointing recomputes it) and the
  backward use the recomputation serves has not ended yet. The post-forward hook of a recomputation may never run
  (torch's non-reentrant checkpoint stops as soon as the last saved tensor is rebuilt), so nothing is counted there;
- ``expected - arrived``: trainable parameters whose gradient accumulation autograd will still run in this
  backward (``torch._C._will_engine_execute_node`` on their accumulators, asked when a use starts): a parameter's
  storage must be whole when its gradient is accumulated, so the unit stays until they are in. If another
  backward use of the unit is still to come (a module called twice, a tied weight) that use gathers it again
  before the accumulation can run, so in between the unit stays only like a unit kept for reuse in forward:
  ``stage3_max_live_parameters`` may evict it (runtime.py ``_must_stay``, read by prefetch.py).

Units nobody needs but that are gathered (prefetched ahead, kept for reuse in forward) are released when their
turn ends, at the end of forward / backward, or first when a gather would exceed ``stage3_max_live_parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UnitNeeds:
    forward_calls: int = 0
    backward_uses: int = 0
    unmarked_uses: int = 0
    recompute_hold: bool = False
    expected: set[int] = field(default_factory=set)  # local parameter indices
    arrived: set[int] = field(default_factory=set)

    @property
    def grads_pending(self) -> bool:
        return not self.expected <= self.arrived

    @property
    def busy(self) -> bool:
        """A call is using the unit right now (forward, backward, or a recomputation for a backward)."""
        return bool(self.forward_calls or self.backward_uses or self.unmarked_uses or self.recompute_hold)

    @property
    def needed(self) -> bool:
        return self.busy or self.grads_pending

    def end_use(self) -> None:
        """A marked backward use ended: the recomputation that served it (if any) is done too."""
        self.backward_uses = max(0, self.backward_uses - 1)
        self.recompute_hold = False

    def grad_arrived(self, index: int) -> None:
        """Once every expected gradient is in, the unmarked uses (which only gradients can end) are over."""
        self.arrived.add(index)
        if self.unmarked_uses and not self.grads_pending:
            self.unmarked_uses = 0
            self.recompute_hold = False

    def reset_backward(self) -> None:
        self.backward_uses = self.unmarked_uses = 0
        self.recompute_hold = False
        self.expected.clear()
        self.arrived.clear()
