"""pin_mmap_threshold: pins glibc's mmap threshold (observed through mallinfo2 in a child process), leaves a
user's MALLOC_MMAP_THRESHOLD_ alone, returns False without glibc, logs each outcome once."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardspeed.log import logger
from shardspeed.offload import malloc

REPO_SRC = Path(__file__).resolve().parents[2] / "src"
IS_GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


@pytest.fixture
def info_records(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Messages the shardspeed logger emits at INFO during the test, with the log-once memory cleared."""
    monkeypatch.setattr(malloc, "_announced", set())
    monkeypatch.delenv(malloc.ENV_OVERRIDE, raising=False)
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


class _StubMallopt:
    """Stands in for glibc's mallopt so this test does not change the test process's allocator (forked ranks
    would inherit it); records its calls."""

    argtypes: object = None
    restype: object = None

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return 1


class _StubLibc:
    def __init__(self) -> None:
        self.mallopt = _StubMallopt()


def test_pins_on_glibc_and_logs_once(info_records: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _StubLibc()
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    first = malloc.pin_mmap_threshold()
    second = malloc.pin_mmap_threshold()
    assert first is True and second is True
    assert libc.mallopt.calls == [(malloc.M_MMAP_THRESHOLD, 65536)] * 2
    assert len(info_records) == 1, info_records
    assert "pinned at 65536 bytes" in info_records[0]


def test_a_users_environment_setting_wins(info_records: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(malloc.ENV_OVERRIDE, "262144")

    def must_not_be_called() -> None:
        raise AssertionError("mallopt reached although MALLOC_MMAP_THRESHOLD_ is set")

    monkeypatch.setattr(malloc, "_glibc", must_not_be_called)
    assert malloc.pin_mmap_threshold() is False
    assert info_records == [
        "malloc: MALLOC_MMAP_THRESHOLD_=262144 is set, so glibc's mmap threshold is left as it chose"
    ]


def test_without_glibc_it_is_a_logged_no_op(info_records: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc.sys, "platform", "darwin")
    assert malloc._glibc() is None
    assert malloc.pin_mmap_threshold() is False
    assert len(info_records) == 1 and "not glibc" in info_records[0]


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True, "64k"])
def test_a_bad_threshold_names_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=r"threshold_bytes = .*valid: a number of bytes from 0 to 2\*\*31 - 1"):
        malloc.pin_mmap_threshold(bad)  # type: ignore[arg-type]


_MMAP_PROBE = """
import ctypes, sys, types
# a bare interpreter (no torch import), so the heap starts small and the allocator state is predictable
for package in ("shardspeed", "shardspeed.offload"):
    stub = types.ModuleType(package)
    stub.__path__ = [sys.argv[1] + "/" + package.replace(".", "/")]
    sys.modules[package] = stub
from shardspeed.offload.malloc import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def served_by_mmap(nbytes):  # hblks counts the blocks malloc currently holds as mmaps of their own
    before = libc.mallinfo2().hblks
    block = libc.malloc(nbytes)
    during = libc.mallinfo2().hblks
    libc.free(block)
    return during > before

pinned = None if sys.argv[2] == "control" else pin_mmap_threshold(*map(int, sys.argv[3:]))
libc.free(libc.malloc(16 << 20))  # freeing an mmapped block raises glibc's dynamic threshold to its size
print(pinned, served_by_mmap(1 << 20), served_by_mmap(32 << 10))
"""


@pytest.mark.skipif(not IS_GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33")
def test_pinned_threshold_keeps_large_blocks_out_of_the_heap() -> None:
    """Control: once a 16 MiB block was freed, glibc serves 1 MiB from the heap (where freed memory stays).
    Pinned at 64 KiB, the same sequence serves 1 MiB by mmap (unmapped on free), 32 KiB still from the heap.
    Pinned at 4 MiB, 1 MiB comes from the heap: the pin sets the value given, not just freezes glibc's 128 KiB."""
    env = {key: value for key, value in os.environ.items() if key != malloc.ENV_OVERRIDE}
    outputs = {}
    for mode in (["control"], ["pin"], ["pin", str(4 << 20)]):
        done = subprocess.run(
            [sys.executable, "-c", _MMAP_PROBE, str(REPO_SRC), *mode], env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[" ".join(mode)] = done.stdout.split()
    assert outputs == {
        "control": ["None", "False", "False"],
        "pin": ["True", "True", "False"],
        f"pin {4 << 20}": ["True", "False", "False"],
    }
