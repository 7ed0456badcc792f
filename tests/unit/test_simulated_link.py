"""[Note: simulated link]: a Work completes only at start + bytes / bandwidth + latency (start: when the rank's one
link is free), waits block until then (never at launch), and the link is off by default."""

from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.comm import Collectives, CommsLog
from shardspeed.comm.composite import Launched
from shardspeed.comm.simulated_link import SimulatedLink
from shardspeed.comm.work import CompositeWork, Work
from shardspeed.config import load_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FinishedHandle:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def _link(clock: FakeClock, gbps: float = 1.0, latency_us: float = 50.0) -> SimulatedLink:
    return SimulatedLink(gbps, latency_us, clock=clock, sleep=clock.sleep)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = SimulatedLink(10.0, 50.0)
    assert link.transfer_s(0) == pytest.approx(50e-6)
    assert link.transfer_s(125_000_000) == pytest.approx(0.1 + 50e-6)  # 1 Gbit at 10 Gbit/s
    with pytest.raises(ValueError, match="bandwidth_gbps must be > 0"):
        SimulatedLink(0.0)


def test_work_is_not_done_before_the_deadline_and_wait_blocks_until_it() -> None:
    clock = FakeClock()
    link = _link(clock)
    hold = link.hold(1_250_000)  # 10 Mbit at 1 Gbit/s: 10 ms + 50 µs
    assert clock.slept == []  # nothing slept at launch
    work = Work(FinishedHandle(), hold=hold)  # the real op already finished
    assert not work.done()
    clock.now += 0.004  # compute overlapping the simulated transfer
    assert not work.done()
    work.wait()
    assert clock.slept == [pytest.approx(0.01005 - 0.004)]  # only the remainder
    assert clock.now == pytest.approx(100.01005) and work.done()


def test_done_turns_true_once_the_deadline_passed_without_waiting() -> None:
    clock = FakeClock()
    done: list[bool] = []
    work = Work(FinishedHandle(), hold=_link(clock).hold(0), on_complete=lambda: done.append(True))
    assert not work.done() and not done
    clock.now += 1.0
    assert work.done() and done == [True]  # the comms log's timer sees the simulated completion
    work.wait()
    assert clock.slept == [] and done == [True]


def test_composite_work_waits_the_deadline_before_its_action() -> None:
    clock = FakeClock()
    finished_at: list[float] = []
    launched = Launched([FinishedHandle()], lambda: finished_at.append(clock.now), ())
    work = CompositeWork(launched, None, str, blocked=None, key="x", hold=_link(clock, 8.0, 0.0).hold(1e9))
    assert not work.done()
    work.wait()
    assert finished_at == [pytest.approx(101.0)]  # 8 Gbit at 8 Gbit/s


def test_off_by_default() -> None:
    assert Collectives(CommsLog()).link is None
    config = load_config({"train_batch_size": 2}, dp_world_size=1)
    assert config.communication.simulated_link is None
    on = load_config(
        {"train_batch_size": 2, "communication": {"simulated_link": {"bandwidth_gbps": 1.0}}}, dp_world_size=1
    )
    assert on.communication.simulated_link is not None
    assert on.communication.simulated_link.latency_us == 0.0
    with pytest.raises(Exception, match="bandwidth_gbps"):
        load_config(
            {"train_batch_size": 2, "communication": {"simulated_link": {"bandwidth_gbps": -1.0}}}, dp_world_size=1
        )


def test_concurrent_calls_share_the_one_link() -> None:
    """Review A #3: calls in flight together queue on the rank's one link; latencies overlap."""
    clock = FakeClock()
    link = _link(clock, 8.0, 1000.0)  # 1 GB/s, 1 ms
    first, second = link.hold(1e8), link.hold(1e8)  # two 0.1 s transfers launched at once
    assert first.at == pytest.approx(100.101)
    assert second.at == pytest.approx(100.201)
    shared = _link(clock, 8.0, 0.0)
    ends = [shared.hold(1.25e8).at - clock.now for _ in range(8)]  # eight 0.125 s transfers
    assert ends == [pytest.approx(0.125 * (k + 1)) for k in range(8)]  # a serial link: the last at 1.0 s
    clock.now += 5.0  # the link idles: a later call starts at its own launch
    assert shared.hold(1.25e8).at == pytest.approx(clock.now + 0.125)


def test_a_call_launched_mid_transfer_waits_only_the_remainder() -> None:
    clock = FakeClock()
    link = _link(clock, 8.0, 0.0)
    link.hold(1e9)  # busy for 1 s
    clock.now += 0.4
    assert link.hold(1e9).at == pytest.approx(102.0)  # starts at 101.0, not at 100.4


def test_an_engine_built_with_the_key_gets_the_link() -> None:
    """Review A #10: engine_setup wires ``communication.simulated_link`` into the engine's Collectives."""
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    plain, *_ = shardspeed.initialize(model=torch.nn.Linear(4, 4), config=base)
    assert plain.collectives.link is None
    sim = {"simulated_link": {"bandwidth_gbps": 2.5, "latency_us": 7.0}}
    engine, *_ = shardspeed.initialize(model=torch.nn.Linear(4, 4), config={**base, "communication": sim})
    link = engine.collectives.link
    assert isinstance(link, SimulatedLink) and (link.bandwidth_gbps, link.latency_us) == (2.5, 7.0)
