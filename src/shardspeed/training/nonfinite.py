"""Non-finite steps: NaN/Inf gradients under fp32/bf16 are skipped and reported; fp16 overflow storms stop.

[Note: non-finite steps] A NaN in one rank's input (or loss) becomes NaN in that rank's gradients, and the mean
that every stage reduces carries it to every rank; the global norm is then NaN everywhere. Stepping on it makes
every weight NaN, so under fp32/bf16 (no loss scaler) such a step is *skipped*, with the bookkeeping of
DeepSpeed's fp16 overflow skip: no parameter, master, optimizer state or LR-schedule step changes; ``global_steps``
and ``skipped_steps`` both advance (DeepSpeed's ``_take_model_step``: ``skipped_steps += 1``, no
``lr_scheduler.step()``, then ``global_steps += 1``), and ``was_step_applied()`` is False. (DeepSpeed's ZeRO-1/2
optimizer, in the versions we looked at, checks for overflow only under fp16 — ``if self.dtype == torch.float16:
self.check_overflow()`` — so there a bf16/fp32 NaN step is applied; older versions checked every dtype.)
A NaN/Inf *loss* shows up through its gradients: a NaN computed from the parameters (``log(0)``, ``0·inf``, an
Inf loss times the 1/GAS and the chain rule's zeros) writes NaN/Inf into them, so it is this same case, skipped and
reported alike. A NaN the parameters do not influence (a constant added to the loss) reaches no gradient: the step
is applied normally and only the logged loss is NaN.

When it is checked (``fault_tolerance.skip_nonfinite_steps``): ``null`` (default) = on whichever step computes the
norm anyway (``gradient_clipping > 0``, or a step whose norm is reported at ``steps_per_print``), so the default
costs nothing; ``true`` = every step (the norm is computed for it: a pass over the gradients and a host sync);
``false`` = the old behaviour, step anyway with a warning.

Agreement ([Note: agreed step] in step_core.py): the verdict comes from the global norm, identical on every rank,
so every rank skips together and the counters below advance alike on every rank without being exchanged. Only the
report's *first offending parameter* needs one extra collective (a MAX all-reduce of one float), and only on the
non-finite path, which every rank takes together: each rank checks its own gradients (stage 0: all of them;
sharded stages and offload: its shard) and the ranks agree on the lowest index in the model's registration order.

The consecutive counts are not saved in checkpoints: they describe the running process's recent steps, and since
every rank derives them from agreed verdicts they cannot desynchronize; a resumed run counts afresh.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shardspeed.comm import Collectives
from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.topology import AxisGroup

__all__ = [
    "FP16ScaleStuckError",
    "NonFiniteGradientsError",
    "NonFiniteGuard",
    "NonFiniteTracker",
    "agree_first_nonfinite",
]


class NonFiniteGradientsError(RuntimeError):
    """``max_consecutive_nonfinite`` consecutive steps had NaN/Inf gradients (raised on every rank)."""


class FP16ScaleStuckError(RuntimeError):
    """fp16 overflowed ``min_loss_scale_patience`` consecutive steps with the loss scale at its minimum."""


@dataclass
class NonFiniteTracker:
    """The pure counting: consecutive non-finite (fp32/bf16) and overflow-at-minimum-scale (fp16) steps.
    ``record_*`` return the error to raise once a limit is reached (None: keep going)."""

    max_consecutive: int
    """fp32/bf16: raise after this many consecutive skipped steps (0: never)."""
    min_scale_patience: int
    """fp16: raise after this many consecutive overflows with the scale at ``min_loss_scale``."""
    steps: list[int] = field(default_factory=list)
    """The current run of consecutive non-finite steps (1-based step numbers)."""
    first_param: str | None = None
    """The first offending parameter of that run's first step."""
    at_min_steps: list[int] = field(default_factory=list)
    """fp16: the current run of consecutive overflows at the minimum scale."""

    def record_nonfinite(self, step: int, param: str | None) -> NonFiniteGradientsError | None:
        if not self.steps:
            self.first_param = param
        self.steps.append(step)
        if self.max_consecutive and len(self.steps) >= self.max_consecutive:
            return NonFiniteGradientsError(
                f"{len(self.steps)} consecutive steps had NaN/Inf gradients ({_span(self.steps)}; first offending "
                f"parameter at the first of them: {_param(self.first_param)}); each was skipped, and "
                f"fault_tolerance.max_consecutive_nonfinite={self.max_consecutive} stops the run. The model or "
                "the data produces non-finite values: check the loss and inputs of those steps, lower the LR, or "
                "enable gradient_clipping"
            )
        return None

    def record_finite(self) -> None:
        self.steps = []
        self.first_param = None

    def record_fp16_overflow(self, step: int, at_min: bool) -> bool:
        """An overflow-skipped step (``at_min``: the loss scale was already at its minimum); True when the patience
        is exhausted (then call ``fp16_error`` with the first offending parameter, located only then)."""
        if not at_min:
            self.at_min_steps = []
            return False
        self.at_min_steps.append(step)
        return len(self.at_min_steps) >= self.min_scale_patience

    def fp16_error(self, scale: float, param: str | None) -> FP16ScaleStuckError:
        return FP16ScaleStuckError(
            f"fp16 loss scale stuck at min_loss_scale={scale:g} for {len(self.at_min_steps)} steps "
            f"({_span(self.at_min_steps)}; first offending parameter at the last of them: {_param(param)}): the "
            "model overflows fp16 even unscaled; use bf16 or lower the LR "
            "(fault_tolerance.min_loss_scale_patience sets how many such steps are tolerated)"
        )

    def record_fp16_clean(self) -> None:
        self.at_min_steps = []


def _span(steps: Sequence[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _param(name: str | None) -> str:
    return name if name is not None else "none (every gradient is finite; their sum of squares overflowed fp32)"


def agree_first_nonfinite(
    local_names: Sequence[str], order: Sequence[str], collectives: Collectives, axis: AxisGroup, device: torch.device
) -> str | None:
    """The first parameter, in ``order`` (the model's registration order), whose gradient holds NaN/Inf on any
    rank of ``axis``; None when none does. ``local_names``: this rank's offenders (its own gradients or shard).
    One MAX all-reduce of one float (of the negated index: MAX of -i is MIN of i), issued on every rank."""
    index = {name: i for i, name in enumerate(order)}
    unknown = len(order)  # a parameter outside the registration order (should not happen): reported by name here
    mine = min((index.get(n, unknown) for n in local_names), default=unknown + 1)
    flag = torch.tensor([-float(mine)], device=device)
    collectives.all_reduce_max(flag, axis, tag="first_nonfinite")
    first = int(-flag.item())
    if first < len(order):
        return order[first]
    if first == unknown:
        return next((n for n in local_names if n not in index), "a parameter outside the model's registration")
    return None


class NonFiniteGuard:
    """The policy of one engine: when to check, what to report, when to raise. Built from the typed config and
    the model's parameter names in registration order (``named_parameters()``)."""

    def __init__(self, config: FaultToleranceConfig, module: torch.nn.Module) -> None:
        self.skip_setting = config.skip_nonfinite_steps
        self.order = [name for name, _ in module.named_parameters()]
        self.tracker = NonFiniteTracker(config.max_consecutive_nonfinite, config.min_loss_scale_patience)

    @property
    def forces_norm(self) -> bool:
        """``skip_nonfinite_steps: true`` computes the norm every step for the check."""
        return self.skip_setting is True

    def fp32_verdict(
        self,
        norm: float,
        computed: bool,
        step: int,
        locate: Callable[[], str | None],
        logger: logging.Logger,
        rank0: bool,
    ) -> tuple[bool, Exception | None]:
        """fp32/bf16: (skip this step?, error to raise after the skip's bookkeeping). ``computed``: the norm was
        computed this step (else it is a placeholder and nothing is known). ``step``: 1-based."""
        if not computed:
            return False, None
        if math.isfinite(norm):
            self.tracker.record_finite()
            return False, None
        first = locate()  # one small collective: every rank is here, the norm is agreed
        if self.skip_setting is False:
            if rank0:
                logger.warning(
                    "step %d: gradient norm is %s (first non-finite gradient: %s); stepping anyway "
                    "(fault_tolerance.skip_nonfinite_steps is false)",
                    step,
                    norm,
                    _param(first),
                )
            return False, None
        error = self.tracker.record_nonfinite(step, first)
        if rank0:
            limit = self.tracker.max_consecutive
            logger.warning(
                "step %d: gradient norm is %s; first non-finite gradient (registration order): %s; step skipped "
                "(%d consecutive%s)",
                step,
                norm,
                _param(first),
                len(self.tracker.steps),
                f", the run stops at {limit}" if limit else "",
            )
        return True, error

    def fp16_overflow(
        self, step: int, at_min: bool, scale: float, locate: Callable[[], str | None]
    ) -> Exception | None:
        """fp16: an overflow-skipped step at loss scale ``scale`` (``at_min``: dynamic scaling already at
        ``min_loss_scale`` before this step's update); the error once that lasted the whole patience."""
        if self.tracker.record_fp16_overflow(step, at_min):
            return self.tracker.fp16_error(scale, locate())  # one small collective, on every rank alike
        return None

    def fp16_clean(self) -> None:
        self.tracker.record_fp16_clean()
