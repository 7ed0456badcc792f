"""``TensorSwapper``: named 1-D tensors swapped to one preallocated file with asynchronous, positional I/O.

NVMe offload keeps optimizer state (and ZeRO-3 parameter shards) in a file and streams it through host memory.
This module is the storage half, in pure Python:

- One file per job, created as ``<nvme_path>/<job_id>/swap.bin`` (a directory of its own, so concurrent jobs and
  ranks never collide) and preallocated with ``posix_fallocate``, so a full disk fails at start with the sizes in
  the message, not in the middle of an optimizer step.
- Nothing stays on disk by name: right after creating the file the swapper unlinks it and removes the job
  directory, keeping only the open file descriptor. Linux frees an unlinked file's blocks when its last
  descriptor closes, and the kernel closes descriptors on any death, SIGKILL and the OOM killer included, so
  swap space never outlives its process (a named file would hold gigabytes until someone deleted it by hand).
  ``path`` and ``directory`` keep the names for messages; they no longer exist once the swapper is set up. (A
  process forked while the swapper is open shares the descriptor, so the space lasts until it exits too.)
- A bounded pool of threads (``aio.thread_count``) does ``pwrite``/``preadv`` at fixed offsets. Both calls release
  the GIL, as does the tensor copy into a staging buffer, so I/O overlaps the caller's compute.
- Data passes through ``aio.queue_depth`` reusable staging buffers of ``aio.block_size`` bytes, allocated with
  anonymous ``mmap`` (always page aligned). Page-aligned buffers, offsets and lengths let the file be opened with
  O_DIRECT, which keeps swap data out of the page cache, so swapping does not inflate host memory. Where the
  filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the swapper falls back to buffered I/O and
  advises the kernel (``POSIX_FADV_DONTNEED``) to drop the pages it has just written or read.
- ``close()`` closes the descriptor, which frees the space at once; so does leaving a ``with`` block by an
  exception, and a ``weakref.finalize`` hook covers a swapper that is dropped or still open at interpreter exit.

Ordering: operations on the same name run in submission order (each waits for the previous operation on that
name), so ``swap_out(x)`` followed at once by ``swap_in(x)`` reads what was written. Operations on different
names run concurrently. The caller must not modify a tensor given to ``swap_out``, or read one given to
``swap_in``, until its handle's ``wait()`` returns.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from types import TracebackType

import torch

from shardspeed.faults.inject import maybe_fail

from .aio_config import PAGE_SIZE, AioSettings
from .aligned import PRIVATE_ANONYMOUS, round_up
from .aligned import aligned_empty as aligned_empty  # re-exported: callers import it from here
from .last_op import ForgetWhenDone
from .swap_file import SWAP_FILE_NAME, SwapSetupError, preallocate, probe_o_direct  # callers import these here


@dataclass
class SwapSlot:
    """Where one named tensor lives in the swap file: ``capacity`` bytes from ``offset`` (both block aligned);
    ``nbytes`` is the size of the tensor last swapped out (0 until then)."""

    name: str
    offset: int
    capacity: int
    nbytes: int = 0


@dataclass
class IOStats:
    """What a swapper's threads did: bytes moved and seconds spent in the syscalls (and their staging copies),
    summed over threads, so concurrent I/O can add up to more than wall time. For the scale benchmark."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0


class SwapHandle:
    """An in-flight ``swap_out``/``swap_in``; ``wait()`` blocks until it is done and re-raises its I/O error."""

    def __init__(self, name: str, futures: list[Future[None]], tensor: torch.Tensor) -> None:
        self.name = name
        self._futures = futures
        self._tensor = tensor  # kept alive until the I/O that reads or fills it is done

    def done(self) -> bool:  # True once every piece has finished, successfully or not
        return all(future.done() for future in self._futures)

    def wait(self) -> torch.Tensor:
        """Block until done; return the tensor that was written from (swap_out) or filled (swap_in)."""
        for future in self._futures:
            future.result()
        return self._tensor


class _Staging:
    """One page-aligned staging buffer: a memoryview for the syscalls and its address for the copies.

    Copies use ``ctypes.memmove`` rather than ``Tensor.copy_``: memmove releases the GIL and is one plain
    single-threaded copy, whereas ``copy_`` from a worker thread starts its own OpenMP team, which on a busy
    machine made it an order of magnitude slower than the disk.
    """

    def __init__(self, size: int) -> None:
        self.memory = mmap.mmap(-1, size, flags=PRIVATE_ANONYMOUS)
        self.view = memoryview(self.memory)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))


_StageCopy = tuple[_Staging, int, int]
"""(staging buffer, caller's memory address, byte count): the copy a staged piece needs before/after its I/O."""
_PieceIO = Callable[[memoryview, int, "_StageCopy | None"], None]
"""Moves one piece (at most one block) between memory and the file at a byte offset."""


class _Resources:
    """What must be released when the swapper goes away; separate from it so ``weakref.finalize`` can hold it.

    ``directory`` and ``file`` are set only while they exist by name (during setup): release removes what is
    left after a failed setup, and never touches a later swapper that reuses the job id."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.file: Path | None = None
        self.fd: int | None = None
        self.executor: ThreadPoolExecutor | None = None

    def unlink_names(self) -> None:
        """Remove the swap file's name and its job directory; the open descriptor keeps the file alive."""
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None
        if self.directory is not None:
            self.directory.rmdir()  # empty: created by this swapper, which put only the swap file in it
            self.directory = None

    def release(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None
        if self.fd is not None:
            os.close(self.fd)  # the last descriptor of an unlinked file: the kernel frees its blocks now
            self.fd = None
        if self.file is not None:  # setup failed before the names were removed
            self.file.unlink(missing_ok=True)
            self.file = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


class TensorSwapper:
    """Swap named 1-D CPU tensors (any dtype) to and from one preallocated, unlinked file on ``nvme_path``.

    ``capacity_bytes`` is the file size to preallocate; each name takes a block-aligned slot, reserved with
    ``reserve`` or on its first ``swap_out``. ``TensorSwapper.bytes_needed`` sizes the file for a set of tensors.
    ``direct_io``: None probes whether the filesystem accepts O_DIRECT; True/False forces the choice.
    ``directory`` (``nvme_path/<job_id>``) and ``path`` (``directory/swap.bin``) are where the file was created:
    names for messages, both removed before the constructor returns (the file lives on through its descriptor).
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        capacity_bytes: int,
        settings: AioSettings | None = None,
        *,
        job_id: str | None = None,
        direct_io: bool | None = None,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes = {capacity_bytes!r}; valid: a positive number of bytes")
        self.settings = settings if settings is not None else AioSettings()
        root = Path(nvme_path)
        self.directory = root / (job_id or f"job-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.path = self.directory / SWAP_FILE_NAME
        self.capacity_bytes = round_up(capacity_bytes, self.settings.block_size)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.directory.mkdir()
        except OSError as error:
            raise SwapSetupError(
                f"nvme_path {str(root)!r} is not usable: cannot create the swap directory {self.directory} "
                f"({error.strerror or error}); nvme_path must be a writable directory on a local disk"
            ) from error
        self._resources = _Resources()
        self._resources.directory = self.directory
        self._finalizer = weakref.finalize(self, self._resources.release)
        try:
            self.direct_io = probe_o_direct(self.directory) if direct_io is None else direct_io
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct_io else 0)
            try:
                self._fd = os.open(self.path, flags, 0o600)
            except OSError as error:
                raise SwapSetupError(f"cannot create the swap file {self.path}: {error.strerror or error}") from error
            self._resources.fd = self._fd
            self._resources.file = self.path
            # Unlink before preallocating: a process killed during a long preallocation leaves nothing behind.
            self._resources.unlink_names()
            preallocate(self._fd, self.path, self.capacity_bytes)
        except BaseException:
            self._finalizer()
            raise
        self._executor = ThreadPoolExecutor(self.settings.thread_count, thread_name_prefix="shardspeed-swap")
        self._resources.executor = self._executor
        self._free_buffers: SimpleQueue[_Staging] = SimpleQueue()
        for _ in range(self.settings.queue_depth):
            self._free_buffers.put(_Staging(self.settings.block_size))
        self._slots: dict[str, SwapSlot] = {}
        self._next_offset = 0
        # name → its latest operation while that is in flight (or failed: flush re-raises it). A finished one is
        # dropped, since its handle holds the tensor: keeping it would keep every swapped-out tensor in memory.
        self._last_op: dict[str, SwapHandle] = {}
        self._last_op_lock = threading.Lock()
        self._closed = False
        self.stats = IOStats()
        self._stats_lock = threading.Lock()

    @staticmethod
    def bytes_needed(tensor_nbytes: Iterable[int], settings: AioSettings | None = None) -> int:
        """File size that holds tensors of these byte sizes, each in its own block-aligned slot."""
        block = (settings or AioSettings()).block_size
        return sum(round_up(max(nbytes, 1), block) for nbytes in tensor_nbytes)

    @property
    def io_mode(self) -> str:
        """ "O_DIRECT" or "buffered+fadvise": which of the two I/O paths this swapper uses."""
        return "O_DIRECT" if self.direct_io else "buffered+fadvise"

    @property
    def names(self) -> list[str]:
        """Names that have a slot in the swap file, in reservation order."""
        return list(self._slots)

    def reserve(self, name: str, nbytes: int) -> SwapSlot:
        """Give ``name`` a slot of at least ``nbytes`` bytes (idempotent for a slot already big enough)."""
        self._check_open()
        slot = self._slots.get(name)
        if slot is not None:
            if nbytes > slot.capacity:
                raise ValueError(
                    f"tensor {name!r} needs {nbytes} bytes but its swap slot holds {slot.capacity}; a name keeps "
                    "the slot size of its first reservation"
                )
            return slot
        capacity = round_up(max(nbytes, 1), self.settings.block_size)
        if self._next_offset + capacity > self.capacity_bytes:
            raise ValueError(
                f"swap file {self.path} is full: tensor {name!r} needs {capacity} bytes at offset "
                f"{self._next_offset}, capacity is {self.capacity_bytes}; size it with TensorSwapper.bytes_needed"
            )
        slot = SwapSlot(name, self._next_offset, capacity)
        self._slots[name] = slot
        self._next_offset += capacity
        return slot

    def swap_out(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing ``tensor`` to ``name``'s slot; do not modify ``tensor`` until the handle is waited."""
        data = self._as_bytes(tensor, "swap_out", name)
        slot = self.reserve(name, data.numel())
        slot.nbytes = data.numel()
        return self._submit(name, tensor, data, self._write_piece)

    def swap_in(self, name: str, out: torch.Tensor) -> SwapHandle:
        """Start reading ``name`` into ``out`` (same byte size as what was swapped out); wait before using it."""
        data = self._as_bytes(out, "swap_in", name)
        slot = self._slots.get(name)
        if slot is None or slot.nbytes == 0:
            raise KeyError(f"swap_in({name!r}): nothing was swapped out under that name; known: {self.names}")
        if data.numel() != slot.nbytes:
            raise ValueError(
                f"swap_in({name!r}): out holds {data.numel()} bytes but {slot.nbytes} bytes were swapped out; "
                "out must have the same byte size"
            )
        return self._submit(name, out, data, self._read_piece)

    def flush(self) -> None:
        """Wait for every operation submitted so far; re-raise the first I/O error."""
        with self._last_op_lock:
            pending = list(self._last_op.values())
        for handle in pending:
            handle.wait()

    def close(self) -> None:
        """Finish outstanding I/O, stop the threads and close the file, freeing its space (also if the I/O failed)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._finalizer()

    def abort(self) -> None:
        """Drop queued I/O, stop the threads and close the file (freeing its space) without waiting for results."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.abort()  # the caller's exception matters more than waiting for I/O it no longer needs

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"TensorSwapper for {self.directory} is closed")

    def _as_bytes(self, tensor: torch.Tensor, operation: str, name: str) -> torch.Tensor:
        """A flat uint8 view of ``tensor``'s memory (no copy), after checking the swapper can use it directly."""
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{operation}({name!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(
                f"{operation}({name!r}): tensor is {tuple(tensor.shape)} on {tensor.device}"
                f"{'' if tensor.is_contiguous() else ', non-contiguous'}; valid: a contiguous 1-D CPU tensor"
            )
        return tensor.view(torch.uint8)

    def _submit(self, name: str, tensor: torch.Tensor, data: torch.Tensor, piece_io: _PieceIO) -> SwapHandle:
        slot = self._slots[name]
        starts = list(range(0, data.numel(), self.settings.block_size))
        with self._last_op_lock:  # same-name operations run in submission order: each waits for the prior one
            prior = self._last_op.get(name)
            if self.settings.single_submit:
                futures = [self._executor.submit(self._run_pieces, piece_io, prior, slot, data, starts)]
            else:
                futures = [self._executor.submit(self._run_pieces, piece_io, prior, slot, data, [s]) for s in starts]
            handle = SwapHandle(name, futures, tensor)
            self._last_op[name] = handle
        forget = ForgetWhenDone(self._last_op, self._last_op_lock, name, weakref.ref(handle), len(futures))
        for future in futures:
            future.add_done_callback(forget)  # outside the lock: runs at once if the future already finished
        if not self.settings.overlap_events:
            handle.wait()
        return handle

    def _run_pieces(
        self, piece_io: _PieceIO, prior: SwapHandle | None, slot: SwapSlot, data: torch.Tensor, starts: list[int]
    ) -> None:
        if prior is not None:
            prior.wait()  # same-name operations in submission order; prior was queued first, so it is running
        block = self.settings.block_size
        writing = piece_io == self._write_piece
        began, moved = time.perf_counter(), 0
        try:
            for start in starts:
                moved += self._one_piece(piece_io, slot, data, start, min(block, data.numel() - start))
        finally:
            elapsed = time.perf_counter() - began
            with self._stats_lock:
                if writing:
                    self.stats.write_bytes += moved
                    self.stats.write_s += elapsed
                else:
                    self.stats.read_bytes += moved
                    self.stats.read_s += elapsed

    def _one_piece(self, piece_io: _PieceIO, slot: SwapSlot, data: torch.Tensor, start: int, length: int) -> int:
        """Move bytes [start, start + length) of ``data``; returns ``length``."""
        address = data.data_ptr() + start
        try:
            if self._can_use_directly(address, length):
                # zero copy: the syscall reads or writes the caller's memory itself
                piece_io(_memory_at(address, length), slot.offset + start, None)
                return length
            staging = self._free_buffers.get()
            try:
                piece_io(staging.view[: round_up(length, PAGE_SIZE)], slot.offset + start, (staging, address, length))
            finally:
                self._free_buffers.put(staging)
            return length
        except OSError as error:
            # pwrite's ENOSPC names no file, and the swap file has no name left on disk: say which one it was
            what = "writing" if piece_io == self._write_piece else "reading"
            raise OSError(
                error.errno,
                f"{error.strerror or error} ({what} {slot.name!r} at byte {slot.offset + start} of swap file "
                f"{self.path}, unlinked at creation)",
            ) from error

    def _can_use_directly(self, address: int, length: int) -> bool:
        """Buffered I/O takes any memory; O_DIRECT only page-aligned memory in whole pages (see ``aligned_empty``)."""
        return not self.direct_io or (address % PAGE_SIZE == 0 and length % PAGE_SIZE == 0)

    def _write_piece(self, view: memoryview, offset: int, stage: _StageCopy | None) -> None:
        if stage is not None:
            staging, address, length = stage
            ctypes.memmove(staging.address, address, length)  # the page-rounded tail is padding inside the slot
        maybe_fail("offload_write", self.path)
        written = 0
        while written < len(view):
            written += os.pwrite(self._fd, view[written:], offset + written)
        if not self.direct_io:
            os.posix_fadvise(self._fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def _read_piece(self, view: memoryview, offset: int, stage: _StageCopy | None) -> None:
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count == 0:
                raise OSError(errno.EIO, f"unexpected end of swap file {self.path} at byte {offset + done}")
            done += count
        if not self.direct_io:
            os.posix_fadvise(self._fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        if stage is not None:
            staging, address, length = stage
            ctypes.memmove(address, staging.address, length)


def _memory_at(address: int, length: int) -> memoryview:
    """A writable memoryview of ``length`` bytes at ``address`` (memory owned by a tensor the handle keeps alive)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")
