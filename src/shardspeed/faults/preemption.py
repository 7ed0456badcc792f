"""Preemption: a signal (SIGTERM by default) asks the run to stop at the next optimizer-step boundary.

A cluster scheduler (SLURM, Kubernetes) or the launcher (torchrun forwards the SIGTERM it gets to every worker)
sends SIGTERM some seconds before it kills. Without a handler the process dies mid-step and everything since the
last save is lost; with one that raises at once, ranks stop at different points and the others wait in a
collective. Here the handler only records the signal; the step core folds it into the all-reduce it issues at
every boundary anyway ([Note: agreed step] in ``training/step_core.py``), so every rank learns in the same step
that *some* rank was asked to stop, even when only one got the signal or one got it a step later. After that step
completes, every rank saves a checkpoint (``fault_tolerance.save_on_preemption``, to ``checkpoint_dir``) and raises
:class:`Preempted`, a ``SystemExit`` with :data:`PREEMPTED_EXIT_CODE`, so an unmodified script exits non-zero after
one log line and no traceback.

The watch is a small state machine:

    UNINSTALLED ──install()──▶ WATCHING ──signal──▶ PENDING ──another signal──▶ ESCALATED (default action restored)
         ▲                         │                   │
         └──────uninstall()────────┴───────────────────┘   (after a preemption stop, at destroy())

[Note: process-wide signal handlers] A signal disposition belongs to the process, not to an engine, so installing
one is unavoidably process-wide state. It is confined to this object: it remembers each previous handler, calls a
previous Python handler too (the script's own, installed before ``initialize``), and puts the previous one back
when it is uninstalled, only if its own handler is still the installed one (so a later handler is never clobbered).
Python runs handlers on the main thread between bytecodes, so the handler only sets an attribute; a rank blocked
in a collective sees the request when the collective returns. A second signal while one is pending restores the
default action (SIG_DFL) for that signal, so a process stuck outside the training loop can still be killed by a
third; the second is not acted on because schedulers and launchers commonly deliver the same SIGTERM twice (to the
process group and forwarded by torchrun).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from shardspeed.faults.errors import mark_agreed

if TYPE_CHECKING:
    from shardspeed.config.fault_tolerance import FaultToleranceConfig
    from shardspeed.engine import ShardSpeedEngine

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionWatch", "parse_signals"]

PREEMPTED_EXIT_CODE = 75
"""Exit status of a preempted run: ``EX_TEMPFAIL`` from sysexits.h ("temporary failure; the user is invited to
retry"), distinct from 1 (an error) and from 128 + N (killed by signal N)."""

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


class Preempted(SystemExit):
    """Raised on every rank after an agreed preemption stop (and its checkpoint). A ``SystemExit``: an unmodified
    script ends with status :data:`PREEMPTED_EXIT_CODE` and without a traceback (the message was logged on every
    rank just before); a script that wants to clean up can catch it like any ``SystemExit``."""

    def __init__(self, message: str, *, signal_name: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        """``checkpoint_dir/tag`` saved at the stop, or None when ``save_on_preemption`` is off."""

    def __str__(self) -> str:
        return self.message


def parse_signals(names: list[str]) -> list[signal.Signals]:
    """``["SIGTERM", "SIGUSR1"]`` (or without the ``SIG`` prefix) → signals; a clear error naming a bad one."""
    out = []
    for name in names:
        key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        sig = getattr(signal.Signals, key, None)
        if sig is None:
            raise ValueError(f"fault_tolerance.preemption_signals: unknown signal {name!r} (e.g. 'SIGTERM')")
        if sig in _UNCATCHABLE:
            raise ValueError(f"fault_tolerance.preemption_signals: {key} cannot be caught")
        out.append(sig)
    return out


class PreemptionWatch:
    """One engine's preemption handling: the signal handlers (``install``), the pending request the step core
    agrees on (``requested``), and the stop after the agreed step (``after_step``)."""

    def __init__(self, config: FaultToleranceConfig, logger: logging.Logger) -> None:
        self.signals = parse_signals(config.preemption_signals)
        self.save = config.save_on_preemption
        self.checkpoint_dir = config.checkpoint_dir
        if self.save and not self.checkpoint_dir:
            raise ValueError("fault_tolerance.save_on_preemption is true but fault_tolerance.checkpoint_dir is not set")
        self.logger = logger
        self.state = "UNINSTALLED"
        self._pending = 0  # signal number received, 0 for none (written only by the handler)
        self._previous: dict[signal.Signals, Any] = {}

    # --- handlers ----------------------------------------------------------------------------------------------
    def install(self) -> bool:
        """Install the handlers; False (with a warning) off the main thread, where Python cannot install any."""
        if not self.signals or self.state != "UNINSTALLED":
            return False
        if threading.current_thread() is not threading.main_thread():
            self.logger.warning(
                "fault_tolerance.preemption_signals: initialize() ran off the main thread, where Python cannot "
                "install signal handlers; %s keep their default action",
                ", ".join(s.name for s in self.signals),
            )
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.state = "WATCHING"
        return True

    def uninstall(self) -> None:
        """Put back the previous handlers (where ours is still the installed one)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.state = "UNINSTALLED"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._pending:
            # A second signal while a stop is pending: the next one gets the default action (see the module note).
            signal.signal(signum, signal.SIG_DFL)
            self.state = "ESCALATED"
            os.write(2, f"[shardspeed] {signal.Signals(signum).name} again: the next one kills the process\n".encode())
            return
        self._pending = signum
        self.state = "PENDING"
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)  # the script's own handler, installed before initialize

    def requested(self) -> int:
        """The signal number received on this rank and not acted on yet (0: none). Read by the step core."""
        return self._pending

    # --- the stop ------------------------------------------------------------------------------------------------
    def after_step(self, engine: ShardSpeedEngine, agreed: int) -> None:
        """After ``engine.step()``: ``agreed`` is the signal number the last boundary's all-reduce agreed on (the
        largest any rank had pending; 0: none). If there is one, save (when configured) and raise
        :class:`Preempted` — on every rank alike, since every rank holds the same ``agreed``."""
        if not agreed:
            return
        self._pending = 0  # acted on: a script that catches Preempted and goes on is not stopped again
        name = signal.Signals(agreed).name
        step = engine.global_steps
        path: Path | None = None
        if self.save:
            assert self.checkpoint_dir is not None
            engine.save_checkpoint(self.checkpoint_dir)  # every rank: it is collective
            path = Path(self.checkpoint_dir) / f"global_step{step}"
            where = f"checkpoint saved to {path}"
        else:
            where = "no checkpoint saved (fault_tolerance.save_on_preemption is false)"
        self.uninstall()
        message = f"preempted by {name} at step {step}; {where}; exiting with status {PREEMPTED_EXIT_CODE}"
        self.logger.warning("rank %d: %s", engine.topology.global_rank, message)
        # Agreed: every rank raises it at the same step, so the failure guard neither publishes it nor fails the engine.
        raise mark_agreed(Preempted(message, signal_name=name, step=step, checkpoint=path))
