"""The comms log's latency, bandwidths, summary table and ZeRO-theory line ([Note: comms-log latency] in
comm/log.py), without processes: a fake clock and fake work handles."""

from __future__ import annotations

import gc
import re
import weakref

import pytest

from shardspeed.comm import api
from shardspeed.comm import log as comm_log
from shardspeed.comm.composite import Launched
from shardspeed.comm.log import CommsLog, ZeroTraffic, convert_size
from shardspeed.comm.work import CompositeWork, Work


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Handle:
    """A torch Work look-alike: finished once ``finished`` is set (or waited)."""

    def __init__(self) -> None:
        self.finished = False

    def wait(self) -> bool:
        self.finished = True
        return True

    def is_completed(self) -> bool:
        return self.finished


def test_latency_runs_from_launch_to_the_wait_and_gives_algorithmic_and_bus_bandwidth() -> None:
    clock = _Clock()
    log = CommsLog(enabled=True, clock=clock)
    timer = log.record("all_reduce", 1000, 4, 4, "grads", "data")  # launched at t=0
    work = Work(_Handle(), key="all_reduce:grads", on_complete=timer)  # type: ignore[arg-type]
    clock.now = 0.002
    work.wait()
    clock.now = 5.0
    work.wait()  # idempotent: recorded once
    t = log.totals["all_reduce:grads"]
    assert (t.count, t.timed, t.axis) == (1, 1, "data")
    assert t.mean_latency_ms == pytest.approx(2.0)
    assert t.algbw_gbps == pytest.approx(4000 * 8 / 0.002 / 1e9)  # bytes / latency, in Gbit/s
    assert t.busbw_gbps == pytest.approx(t.algbw_gbps * 2 * 3 / 4)  # NCCL-tests: 2(n-1)/n for all-reduce


@pytest.mark.parametrize(("op", "factor"), [("all_gather", 0.75), ("reduce_scatter", 0.75), ("broadcast", 1.0)])
def test_bus_bandwidth_factors_follow_nccl_tests(op: str, factor: float) -> None:
    clock = _Clock()
    log = CommsLog(enabled=True, clock=clock)
    timer = log.record(op, 256, 2, 4, "x")
    clock.now = 1.0
    timer()
    t = log.totals[f"{op}:x"]
    assert t.busbw_gbps == pytest.approx(t.algbw_gbps * factor)
    assert t.algbw_gbps == pytest.approx(512 * 8 / 1e9)


def test_an_async_handle_seen_complete_by_done_is_timed_then() -> None:
    clock = _Clock()
    log = CommsLog(enabled=True, clock=clock)
    handle = _Handle()
    work = Work(handle, on_complete=log.record("all_gather", 8, 4, 2, "params"))  # type: ignore[arg-type]
    clock.now = 1.0
    assert not work.done()
    assert log.totals["all_gather:params"].timed == 0  # not finished: nothing timed yet
    handle.finished = True
    clock.now = 3.0
    assert work.done()
    clock.now = 10.0
    work.wait()  # already seen complete: the latency stays launch → first observation
    t = log.totals["all_gather:params"]
    assert t.timed == 1 and t.latency_s == pytest.approx(3.0)


def test_a_composite_collective_is_timed_after_its_completion_action() -> None:
    clock = _Clock()
    log = CommsLog(enabled=True, clock=clock)
    order = []

    def finish() -> None:
        order.append(("finish", clock.now))

    launched = Launched(handles=[_Handle(), _Handle()], finish=finish, keep=())
    work = CompositeWork(
        launched,  # type: ignore[arg-type]
        None,
        str,
        blocked=None,
        key="reduce_scatter:grads",
        on_complete=log.record("reduce_scatter", 8, 4, 2, "grads"),
    )
    clock.now = 0.5
    work.wait()
    assert order == [("finish", 0.5)]
    assert log.totals["reduce_scatter:grads"].latency_s == pytest.approx(0.5)


def test_disabled_or_filtered_logs_return_no_timer() -> None:
    assert CommsLog(enabled=False).record("all_reduce", 4, 4, 2) is None
    filtered = CommsLog(enabled=True, prof_ops=("all_gather",))
    assert filtered.record("all_reduce", 4, 4, 2) is None
    assert filtered.record("all_gather", 4, 4, 2) is not None
    assert list(filtered.totals) == ["all_gather"]


@pytest.mark.parametrize(
    ("stage", "gas", "multiple"), [(0, 1, 2.0), (1, 4, 2.0), (2, 1, 2.0), (2, 3, 4.0), (3, 1, 3.0), (3, 2, 6.0)]
)
def test_zero_traffic_theory_per_optimizer_step(stage: int, gas: int, multiple: float) -> None:
    theory = ZeroTraffic(stage, 1000, 4, gas)
    assert theory.psi_multiple == multiple
    assert theory.elements_per_step == multiple * 0.75 * 1000
    assert ZeroTraffic(stage, 1000, 1, gas).elements_per_step == 0.0


def test_summary_has_deepspeeds_columns_and_compares_data_parallel_traffic_with_theory() -> None:
    clock = _Clock()
    log = CommsLog(enabled=True, clock=clock)
    log.theory = ZeroTraffic(stage=1, numel=1000, dp_world=2)
    assert "no optimizer step logged yet" in log.summary()
    for _ in range(2):  # two steps of ZeRO-1: a reduce-scatter and an all-gather of Ψ each
        log.record("reduce_scatter", 1000, 4, 2, "grads", "data")()
        log.record("all_gather", 1000, 4, 2, "params", "data")()
        log.record("all_reduce", 5, 4, 2, "step_checks", "data")()  # not ZeRO's traffic
        log.record("all_gather", 1000, 4, 2, "params", "tensor")()  # another axis: not data-parallel traffic
        log.on_step(object())
    assert log.data_parallel_elements() == 2 * 2 * 500
    text = log.summary()
    header = text.splitlines()[0]
    for column in ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)"):
        assert column in header
    assert "busbw_avg (Gbps)" in header
    assert "reduce_scatter:grads" in text and "3.91 KB" in text
    assert text.splitlines()[-1] == (
        "data-parallel traffic per step: 1,000 elements per rank over 2 step(s); "
        "ZeRO-1 theory 2Ψ·(N−1)/N = 1,000 (Ψ=1,000, N=2, gas=1): 1.000× theory"
    )
    log.reset()
    assert log.steps == 0 and not log.totals


def test_convert_size_matches_deepspeed() -> None:
    assert (convert_size(0), convert_size(512), convert_size(4096), convert_size(3 * 2**20)) == (
        "0B",
        "512.0 B",  # DeepSpeed divides by a float power too
        "4.0 KB",
        "3.0 MB",
    )


def test_log_summary_finds_the_one_enabled_log_or_says_what_to_call(capsys, monkeypatch) -> None:
    monkeypatch.setattr(comm_log, "_live_logs", weakref.WeakSet())  # other tests' engines may still be alive
    with pytest.raises(RuntimeError, match=re.escape('"comms_logger": {"enabled": true}')):
        api.log_summary()
    log = CommsLog(enabled=True)
    log.record("all_reduce", 4, 4, 2, "grads")()
    result = api.log_summary(return_dict=True)
    assert "all_reduce:grads" in capsys.readouterr().out
    assert result is not None and result["summary"]["all_reduce:grads"]["count"] == 1
    other = CommsLog(enabled=True)
    with pytest.raises(RuntimeError, match=r"2 live engines .* pass engine="):
        api.log_summary()

    class _Engine:
        comms_log = other

    assert api.log_summary(engine=_Engine()) is None
    del log, _Engine
    gc.collect()
    assert comm_log.live_logs() == [other]  # a dropped engine's log leaves the set by itself


def test_calls_the_host_cannot_see_complete_nccl_are_counted_but_not_timed() -> None:
    # NCCL's wait() returns once the kernel is enqueued: a host clock would time the launch, not the wire
    clock = _Clock()
    log = CommsLog(enabled=True, clock=clock, host_waits=False)
    assert log.record("all_reduce", 1000, 4, 2, "grads", "data") is None  # no timer to call
    totals = log.totals["all_reduce:grads"]
    assert (totals.count, totals.timed, totals.enqueue_only, totals.busbw_gbps) == (1, 0, 1, None)
    header, row = log.summary().splitlines()[:2]
    assert "timed" in header
    assert row.split()[0] == "all_reduce:grads" and row.count("n/a (nccl)") == 4  # latencies and bandwidths
    assert log.rows()["all_reduce:grads"]["timed"] == 0


def test_a_log_enabled_after_construction_is_found_by_log_summary(monkeypatch) -> None:
    monkeypatch.setattr(comm_log, "_live_logs", weakref.WeakSet())
    log = CommsLog(enabled=False)
    assert comm_log.live_logs() == []
    log.enabled = True  # engine.comms_log.enabled = True
    assert comm_log.live_logs() == [log]


def test_a_prof_ops_filtered_log_is_not_compared_with_the_theory() -> None:
    log = CommsLog(enabled=True, prof_ops=("reduce_scatter",))
    log.theory = ZeroTraffic(stage=1, numel=1000, dp_world=2)
    log.record("reduce_scatter", 1000, 4, 2, "grads", "data")()
    log.record("all_gather", 1000, 4, 2, "params", "data")  # filtered out: not logged
    log.on_step(object())
    assert log.theory_line() == (
        "ZeRO traffic theory: not compared (comms_logger.prof_ops leaves out all_gather, all_reduce)"
    )


def test_summary_counts_compressed_traffic_against_the_fp32_ring() -> None:
    """The 1-bit tags are data-parallel traffic too: the summary's compressed line shows the 1/32 they buy."""
    log = CommsLog(enabled=True)
    log.theory = ZeroTraffic(stage=0, numel=32_000, dp_world=2)
    for _ in range(2):  # two steps of one compressed mean: signs exchanged, then gathered (1 byte per element)
        log.record("all_to_all", 4_000, 1, 2, "compressed:group0", "data")
        log.record("all_gather", 4_000, 1, 2, "compressed:group0", "data")
        log.record("all_reduce", 10, 4, 2, "ZeroOneAdam:exact", "data")
        log.record("all_reduce", 1, 4, 2, "grad_norm", "data")  # neither
        log.on_step(object())
    assert log.optimizer_bytes() == (8_000.0, 80.0)
    line = log.compressed_line()
    assert line == (
        "1-bit data-parallel traffic per step: 4,040 bytes per rank over 2 step(s) (1-bit 4,000, exact fp32 means "
        "40); fp32 ring all-reduce of Ψ 8Ψ·(N−1)/N = 128,000 bytes: 1.010/32"
    )
    assert line in log.summary().splitlines()
    log.record("reduce_scatter", 64_000, 1, 2, "grads_1bit", "data")  # ZeRO-1/2's compressed reduce-scatter
    assert log.optimizer_bytes()[0] == 8_000 + 32_000
    plain = CommsLog(enabled=True)
    plain.theory = ZeroTraffic(stage=0, numel=100, dp_world=2)
    plain.record("all_reduce", 100, 4, 2, "grads", "data")
    plain.on_step(object())
    assert plain.compressed_line() == "" and "1-bit" not in plain.summary()
