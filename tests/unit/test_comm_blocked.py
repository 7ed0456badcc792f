"""BlockedTime ([Note: exposed communication] in comm/blocked.py): real waits are timed, finished ones are not."""

from __future__ import annotations

import time

from shardspeed.comm.blocked import BlockedTime
from shardspeed.comm.collectives import Work


class _Handle:
    """A torch Work look-alike that takes ``delay`` seconds to finish."""

    def __init__(self, delay: float) -> None:
        self.delay, self.waited = delay, 0

    def wait(self) -> bool:
        time.sleep(self.delay)
        self.waited += 1
        return True

    def is_completed(self) -> bool:
        return self.waited > 0


def test_a_pending_wait_is_timed_once_under_its_key() -> None:
    meter = BlockedTime()
    handle = _Handle(0.02)
    work = Work(handle, blocked=meter, key="all_gather:params")  # type: ignore[arg-type]
    work.wait()
    work.wait()  # idempotent: nothing more recorded
    assert handle.waited == 1
    assert meter.waits == {"all_gather:params": 1}
    assert 0.015 < meter.total("all_gather") < 1.0
    assert meter.total("reduce") == 0.0
    assert "all_gather:params" in meter.summary()
    meter.reset()
    assert meter.total() == 0.0


def test_a_finished_no_op_records_nothing() -> None:
    meter = BlockedTime()
    Work(None, blocked=meter, key="x").wait()
    assert meter.total() == 0.0 and not meter.waits
