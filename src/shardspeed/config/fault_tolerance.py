"""``fault_tolerance``: shardspeed's own section (not a DeepSpeed key) for what happens when something goes wrong.

DeepSpeed has no such section: a fault on one rank leaves the others waiting in a collective, a NaN under fp32
steps anyway, SIGTERM kills mid-step. Each key below is read by one module of ``shardspeed.faults`` (failure
propagation, collective-order verification, preemption, resume) or by the step core (non-finite gradients).
"""

from __future__ import annotations

from pydantic import Field

from .base import ConfigModel, NonNegativeInt, PositiveFloat, PositiveInt


class FaultToleranceConfig(ConfigModel):
    """``fault_tolerance``: failure propagation, collective-order checks, non-finite steps, preemption, resume."""

    propagate_failures: bool = True
    """An exception on one rank inside an engine call, or uncaught in the script, makes every rank raise an error
    naming the failing rank and its exception (instead of waiting in the next collective). Default: true."""

    watch_interval_s: PositiveFloat = 0.5
    """How often each rank looks for a peer's published failure while it waits in a collective. Default 0.5 s."""

    collective_timeout_s: PositiveFloat | None = None
    """Process-group timeout used when ``initialize`` creates the group: a collective whose peer never arrives
    fails after this long. Default: 600 s on CPU (gloo), 1800 s with CUDA (NCCL, torch's default)."""

    verify_collective_order: bool = False
    """Debug: before each collective the library issues, ranks agree on its fingerprint (op, dtype, shape, group,
    call site); a divergence raises on every rank naming both calls. Costs up to ~2x step time. Also turned on by
    the environment variable ``SHARDSPEED_VERIFY_COLLECTIVES=1`` (every rank must agree; checked at initialize).
    Default: false."""

    skip_nonfinite_steps: bool | None = None
    """fp32/bf16: a step whose gradients hold NaN/Inf (a NaN/Inf loss computed from the parameters makes them so)
    is skipped on every rank — only ``global_steps`` and ``skipped_steps`` advance, as in DeepSpeed — and reported
    on rank 0 (step, first offending parameter in registration order). ``null`` (default): checked whenever the
    gradient norm is computed anyway (``gradient_clipping > 0``, a ``steps_per_print`` step); ``true``: every step
    (computes the norm every step); ``false``: step anyway, with a warning (weights become NaN)."""

    max_consecutive_nonfinite: NonNegativeInt = 5
    """Raise after this many consecutive skipped non-finite steps (fp32/bf16); 0 = never raise. Default 5."""

    min_loss_scale_patience: PositiveInt = 10
    """fp16: raise after this many consecutive overflow-skipped steps with the loss scale at ``min_loss_scale``
    (an overflow storm that lowering the scale cannot cure). Default 10."""

    checkpoint_dir: str | None = None
    """Where a preemption saves and where ``auto_resume`` loads from. Default: none."""

    save_on_preemption: bool = False
    """On a preemption signal, save a checkpoint to ``checkpoint_dir`` at the next step boundary before exiting.
    Default: false."""

    auto_resume: bool = False
    """At ``initialize``, load the latest checkpoint in ``checkpoint_dir`` if there is one (elastic restarts
    continue from their last save). Default: false."""

    preemption_signals: list[str] = Field(default_factory=lambda: ["SIGTERM"])
    """Signals that request a stop at the next step boundary (e.g. ``["SIGTERM", "SIGUSR1"]``); ``[]`` keeps the
    default signal behaviour. Default: SIGTERM."""
