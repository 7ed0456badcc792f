"""Pinning glibc's mmap threshold, so memory freed during an offloaded step goes back to the kernel.

glibc serves a ``malloc`` above the *mmap threshold* (128 KiB at start) with its own ``mmap``, which ``free``
returns to the kernel at once; smaller requests come from the heap, whose freed space is kept for reuse. By
default the threshold is dynamic: freeing an mmapped block raises it to that block's size (up to 32 MiB). An
offloaded step frees large blocks early (a gathered unit, a streamed chunk), after which every later temporary
of up to that size comes from the heap instead, and a fragmented heap is not given back: resident memory
settles several times above what the step really holds. Setting the threshold explicitly (``mallopt``, or the
``MALLOC_MMAP_THRESHOLD_`` environment variable read at process start) turns the dynamic adjustment off.
``pin_mmap_threshold`` does that from Python, so users need no environment tricks; the engine calls it before it
allocates model states when a config offloads to NVMe (bounded host memory is what NVMe offload is for).

The price is CPU time: every allocation of 64 KiB or more becomes a fresh mapping, page-faulted on first touch.
Measured here: a CPU MLP's step ~35-40% slower, and the bounded-memory test's step 3.5 s instead of 2.3 s with
the threshold left dynamic. Higher fixed thresholds trade memory back for speed: 256 KiB and 1 MiB still held the
test at ~200 MiB per rank (with the same slowdown on the MLP), 4 MiB let it grow to 438 MiB, 32 MiB to 656 MiB.
A user who prefers speed sets ``MALLOC_MMAP_THRESHOLD_`` (e.g. 33554432) before the process starts; this function
then leaves glibc alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

from shardspeed.log import logger

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (from <malloc.h>)."""
ENV_OVERRIDE = "MALLOC_MMAP_THRESHOLD_"
DEFAULT_THRESHOLD_BYTES = 1 << 16

_announced: set[str] = set()
"""Log messages already written: ``pin_mmap_threshold`` runs each time a swapper is opened, but says so once."""


def _announce_once(message: str) -> None:
    if message not in _announced:
        _announced.add(message)
        logger.info(message)


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (``mallopt`` is glibc's; musl and others lack it or ignore it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    # only glibc exports gnu_get_libc_version; musl has mallopt as a stub that ignores its arguments
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def pin_mmap_threshold(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` (``mallopt(M_MMAP_THRESHOLD, ...)``); True if it did.

    Returns False, changing nothing, when ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (the user's
    choice wins), when the C library is not glibc, or when glibc refuses the value: never raises for those
    (only for a ``threshold_bytes`` that is not a byte count a C int holds). Each outcome is logged once at
    INFO; repeated calls are cheap and harmless.
    """
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int) or not 0 <= threshold_bytes < 2**31:
        raise ValueError(
            f"threshold_bytes = {threshold_bytes!r}; valid: a number of bytes from 0 to 2**31 - 1 (mallopt takes a "
            "C int)"
        )
    chosen = os.environ.get(ENV_OVERRIDE)
    if chosen is not None:
        _announce_once(f"malloc: {ENV_OVERRIDE}={chosen} is set, so glibc's mmap threshold is left as it chose")
        return False
    libc = _glibc()
    if libc is None:
        _announce_once("malloc: not glibc, so the mmap threshold is not pinned (nothing to do)")
        return False
    try:
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        accepted = libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1
    except (OSError, ctypes.ArgumentError) as error:
        _announce_once(f"malloc: mallopt(M_MMAP_THRESHOLD, {threshold_bytes}) failed ({error}); threshold unchanged")
        return False
    if not accepted:
        _announce_once(f"malloc: glibc refused an mmap threshold of {threshold_bytes} bytes; threshold unchanged")
        return False
    _announce_once(
        f"malloc: glibc's mmap threshold pinned at {threshold_bytes} bytes, so buffers freed during offloaded "
        f"steps return to the kernel instead of growing the heap (set {ENV_OVERRIDE} to choose another value)"
    )
    return True
