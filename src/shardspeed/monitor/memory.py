"""Per-rank memory figures the monitors log: peak host memory, peak device memory, model-state bytes.

[Note: host peak = VmHWM] The host figure is the process's resident-set high-water mark, ``VmHWM`` from
``/proc/self/status`` (bytes, Linux), as the engine benchmarks measure peak memory. ``getrusage``'s ``ru_maxrss``
is the fallback elsewhere (KiB on Linux, bytes on macOS): on Linux it is kept across ``exec`` (a process started by a
launcher that exec'd inherits the launcher's peak), so it can overstate this process's own peak. Neither can be
reset: the figure is the peak since the process started, model construction included.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping

import torch

__all__ = ["device_peak_bytes", "host_peak_bytes", "model_state_total"]

TRANSIENT_KEYS = frozenset({"peak_bucket_bytes"})
"""``engine.memory_breakdown()`` keys that are not model states (in-flight buckets / gathered units)."""


def host_peak_bytes() -> int:
    """[Note: host peak = VmHWM]."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def device_peak_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated by torch on ``device`` (CUDA's ``max_memory_allocated``); None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def model_state_total(breakdown: Mapping[str, int]) -> int:
    """Model-state bytes of ``engine.memory_breakdown()``: every role but the transient buckets."""
    return sum(v for k, v in breakdown.items() if k not in TRANSIENT_KEYS)
