"""fp16 loss scaling: static, or dynamic with hysteresis (DeepSpeed's semantics).

Dynamic rule, per optimizer step:
- overflow → skip the step; if hysteresis is exhausted, halve the scale (never below ``min_scale``), else spend one
  unit of hysteresis; the clean-step counter restarts.
- ``window`` consecutive clean steps → double the scale; without ``consecutive_hysteresis`` the hysteresis budget
  is refilled only then, with it the budget refills after every clean step.
All ranks see the same overflow flag (it is computed from reduced gradients), so scales never diverge.

At ``min_scale`` halving is no longer possible: DeepSpeed raises "Current loss scale already at minimum" on the
first overflow there (once hysteresis is spent). We keep skipping and let the step core stop the run after
``fault_tolerance.min_loss_scale_patience`` consecutive such overflows (``at_minimum``; training/nonfinite.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScalerState:
    scale: float
    clean_steps: int = 0
    hysteresis_left: int = 1
    skipped_steps: int = 0


class LossScaler:
    """Multiplies the loss before backward; divides it out of the gradients; adapts when dynamic."""

    def __init__(
        self,
        *,
        dynamic: bool,
        init_scale: float,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
    ) -> None:
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.state = LossScalerState(scale=float(init_scale), hysteresis_left=hysteresis)

    @property
    def scale(self) -> float:
        return self.state.scale

    @property
    def at_minimum(self) -> bool:
        """Dynamic scaling that can go no lower: an overflow now is not cured by lowering the scale."""
        return self.dynamic and self.state.scale <= self.min_scale

    def update(self, overflow: bool) -> str | None:
        """Advance after a step; returns a one-line message when the scale changed on overflow (for the log)."""
        s = self.state
        if overflow:
            s.skipped_steps += 1
            s.clean_steps = 0
            if not self.dynamic:
                return f"fp16 overflow with static loss scale {s.scale:g}: step skipped"
            if s.hysteresis_left > 1:
                s.hysteresis_left -= 1
                return f"fp16 overflow: step skipped, loss scale kept at {s.scale:g} (hysteresis {s.hysteresis_left})"
            old = s.scale
            s.scale = max(s.scale / 2.0, self.min_scale)
            if s.scale == old:
                return f"fp16 overflow: step skipped, loss scale already at min_loss_scale {old:g}"
            return f"fp16 overflow: step skipped, loss scale {old:g} -> {s.scale:g}"
        if not self.dynamic:
            return None
        s.clean_steps += 1
        if self.consecutive_hysteresis:
            s.hysteresis_left = self.hysteresis
        if s.clean_steps % self.window == 0:
            s.scale *= 2.0
            s.hysteresis_left = self.hysteresis
        return None

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = LossScalerState(**state)
