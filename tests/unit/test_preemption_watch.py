"""The preemption watch's signal handling on one process: the handler only records the signal, chains and
restores the previous handler, and a second signal while one is pending restores the default action."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from shardspeed.config.fault_tolerance import FaultToleranceConfig
from shardspeed.faults.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch, parse_signals

LOG = logging.getLogger("test-preemption")


def _watch(**fields: object) -> PreemptionWatch:
    return PreemptionWatch(FaultToleranceConfig(**fields), LOG)


def test_handler_records_chains_escalates_and_restores() -> None:
    seen: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        script_handler = signal.getsignal(signal.SIGUSR1)
        watch = _watch(preemption_signals=["SIGUSR1"])
        assert watch.install()
        assert watch.requested() == 0
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread before the next bytecode
        assert watch.requested() == signal.SIGUSR1
        assert watch.state == "PENDING"
        assert seen == [signal.SIGUSR1]  # the script's own handler was still called
        os.kill(os.getpid(), signal.SIGUSR1)  # second while pending: the next one would kill
        assert watch.state == "ESCALATED"
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        assert seen == [signal.SIGUSR1]
        watch.uninstall()  # ours is no longer installed: SIG_DFL stays, nothing clobbered
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL

        signal.signal(signal.SIGUSR1, script_handler)
        watch = _watch(preemption_signals=["USR1"])
        watch.install()
        watch.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == script_handler  # restored
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_no_signals_installs_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    watch = _watch(preemption_signals=[])
    assert not watch.install()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    ("names", "error"),
    [(["SIGNOPE"], "unknown signal 'SIGNOPE'"), (["SIGKILL"], "SIGKILL cannot be caught")],
)
def test_bad_signal_names_are_named(names: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_signals(names)


def test_save_without_directory_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"save_on_preemption is true but fault_tolerance\.checkpoint_dir"):
        _watch(save_on_preemption=True)


def test_preempted_is_a_quiet_system_exit_with_its_own_code() -> None:
    stop = Preempted("preempted by SIGTERM at step 3; ...", signal_name="SIGTERM", step=3, checkpoint=None)
    assert isinstance(stop, SystemExit)
    assert stop.code == PREEMPTED_EXIT_CODE != 1
    assert str(stop).startswith("preempted by SIGTERM at step 3")


def test_a_stop_agreed_at_a_step_that_raised_is_not_acted_on_later() -> None:
    """A boundary that agreed a stop but raised (here: its backward had raised) must not leave the stop behind for
    a later micro-step to act on mid-accumulation; the signal stays pending and is agreed again next boundary."""
    import torch

    import shardspeed

    model = torch.nn.Linear(4, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fault_tolerance": {"preemption_signals": []},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)

    def boom(grad: torch.Tensor) -> None:
        raise ValueError("boom")

    out = engine(torch.ones(2, 4))
    out.register_hook(boom)
    with pytest.raises(ValueError):
        out.sum().backward()
    engine._core.agreed_stop = int(signal.SIGTERM)  # as if this boundary's agreement had carried a stop
    with pytest.raises(RuntimeError, match="the last backward raised"):
        engine.step()
    assert engine._core.take_stop() == 0
