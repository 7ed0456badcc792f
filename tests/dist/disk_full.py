"""A really full disk for the disk-fault tests: a 2 MiB tmpfs (root only; skipped where mounting is not permitted)
and a helper that fills a file system."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def fill(path: Path) -> None:
    """Write ``path`` until its file system is full."""
    block = b"\0" * 4096
    with open(path, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError:
            pass


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted under ``tmp_path``, unmounted afterwards."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({result.stderr.strip() or result.returncode})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
