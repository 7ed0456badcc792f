"""Making a ``TensorSwapper``'s file: the O_DIRECT probe, preallocation, and the errors setup reports.

The swapper creates its file by name and unlinks it at once (see swapper.py); everything here works through the
open descriptor, so it does not matter that the name is gone by the time the file is preallocated.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

from shardspeed.faults.inject import maybe_fail

from .aio_config import PAGE_SIZE

SWAP_FILE_NAME = "swap.bin"
FULL_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class SwapSetupError(RuntimeError):
    """The swap directory or file could not be created: unwritable path or not enough free space."""


def probe_o_direct(directory: Path) -> bool:
    """Whether files in ``directory`` accept O_DIRECT: open a probe file with it and write one aligned page."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".o_direct_probe"
    page = mmap.mmap(-1, PAGE_SIZE)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        page.close()
        probe.unlink(missing_ok=True)  # some filesystems create the file, then refuse O_DIRECT
        return False
    probe.unlink(missing_ok=True)  # at once, like the swap file: the write below goes through the descriptor
    try:
        return os.pwrite(fd, page, 0) == PAGE_SIZE
    except OSError:
        return False
    finally:
        os.close(fd)
        page.close()


def preallocate(fd: int, path: Path, nbytes: int) -> None:
    """Reserve ``nbytes`` on disk now, so a full disk is reported here rather than mid-step. ``path`` is only
    for messages: the file may already be unlinked, so free space is measured through the descriptor."""
    try:
        maybe_fail("offload_setup", path)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno in FULL_DISK_ERRNOS:
            filesystem = os.fstatvfs(fd)
            free = filesystem.f_bavail * filesystem.f_frsize  # what shutil.disk_usage calls free
            if free >= nbytes:  # a quota (EDQUOT), a file-size limit (EFBIG), or space taken since
                raise SwapSetupError(
                    f"cannot preallocate the swap file {path}: it needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) "
                    f"and the file system reports {free} bytes free, but the allocation failed ({error.strerror}); "
                    "check quotas and file-size limits there, or point nvme_path at another device"
                ) from error
            raise SwapSetupError(
                f"cannot preallocate the swap file {path}: it needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) but "
                f"only {free} bytes ({free / 2**30:.2f} GiB) are free there ({error.strerror}); free space, point "
                "nvme_path at a larger device, or swap fewer tensors"
            ) from error
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            # no fallocate on this filesystem: a sparse file is the best we can do, and a full disk then shows
            # as ENOSPC from the write, raised by the handle's wait()
            os.ftruncate(fd, nbytes)
            return
        raise SwapSetupError(f"cannot preallocate {nbytes} bytes for the swap file {path}: {error}") from error
