"""Read memory counters from Linux's /proc/<pid>/status.

VmHWM ("high water mark") is the peak resident set size of the process since it started; VmRSS is the current
one. Both are process-wide, which is why the benchmark measures each row's peak in a process of its own.
"""

from __future__ import annotations

from pathlib import Path

STATUS_PATH = Path("/proc/self/status")


def parse_status_kib(status_text: str, field: str) -> int:
    """The value of ``field`` (e.g. "VmHWM") in a /proc status text, in KiB (the kernel's "kB" means KiB)."""
    prefix = f"{field}:"
    for line in status_text.splitlines():
        if line.startswith(prefix):
            parts = line[len(prefix) :].split()
            if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
                raise ValueError(f"status line for {field} is {line!r}; expected '{field}: <integer> kB'")
            return int(parts[0])
    raise KeyError(f"no '{field}:' line in the status text (fields such as VmHWM and VmRSS exist on Linux)")


def read_status_mib(field: str, path: Path = STATUS_PATH) -> float:
    """``field`` of this process's status file, in MiB."""
    return parse_status_kib(path.read_text(), field) / 1024.0
