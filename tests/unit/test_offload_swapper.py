"""TensorSwapper: round trips, concurrency and ordering, O_DIRECT fallback, setup errors, and cleanup: the swap
file is unlinked at setup, so nothing is ever left under nvme_path (not even after SIGKILL) and closing the
descriptor frees the space."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from harness import deleted_files_held
from shardspeed.offload import swapper as swapper_module
from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.swapper import SwapSetupError, TensorSwapper, aligned_empty

SMALL_BLOCKS = AioSettings(block_size=8192, queue_depth=2, thread_count=3)
REPO_SRC = Path(__file__).resolve().parents[2] / "src"


def _fallocate_allocates(directory: Path) -> bool:
    """Whether posix_fallocate in ``directory`` allocates blocks (where it does not, the swapper's file is sparse)."""
    with tempfile.TemporaryFile(dir=directory) as probe:
        try:
            os.posix_fallocate(probe.fileno(), 0, 1 << 20)
        except OSError:
            return False
        return os.fstat(probe.fileno()).st_blocks * 512 >= 1 << 20


def _pattern(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(0, 120, (numel,), generator=generator).to(dtype)


def test_round_trip_of_many_tensors_with_odd_sizes_and_dtypes(tmp_path: Path) -> None:
    specs = [(1, torch.float32), (1000, torch.float32), (2049, torch.float32), (12345, torch.float32),
             (8193, torch.bfloat16), (777, torch.int64), (30001, torch.uint8)]  # fmt: skip
    originals = {f"t{i}": _pattern(numel, dtype, seed=i) for i, (numel, dtype) in enumerate(specs)}
    capacity = TensorSwapper.bytes_needed([t.nbytes for t in originals.values()], SMALL_BLOCKS)
    with TensorSwapper(tmp_path, capacity, SMALL_BLOCKS) as swapper:
        for name, tensor in originals.items():
            swapper.swap_out(name, tensor.clone()).wait()
        for name, tensor in reversed(originals.items()):
            out = torch.full_like(tensor, 7)
            swapper.swap_in(name, out).wait()
            assert torch.equal(out, tensor), name
        assert swapper.names == list(originals)


@pytest.mark.parametrize("single_submit", [False, True])
def test_many_in_flight_operations_and_same_name_ordering(tmp_path: Path, single_submit: bool) -> None:
    settings = AioSettings(block_size=4096, queue_depth=3, thread_count=4, single_submit=single_submit)
    sources = [_pattern(5000 + 97 * i, torch.float32, seed=i) for i in range(16)]
    with TensorSwapper(tmp_path, TensorSwapper.bytes_needed([s.nbytes for s in sources], settings), settings) as sw:
        writes = [sw.swap_out(f"x{i}", source) for i, source in enumerate(sources)]  # none waited yet
        outs = [torch.empty_like(source) for source in sources]
        reads = [sw.swap_in(f"x{i}", out) for i, out in enumerate(outs)]  # reads queued behind their writes
        for handle in writes + reads:
            handle.wait()
        for source, out in zip(sources, outs):
            assert torch.equal(out, source)
        # write, overwrite, read back without waiting in between: the read must see the second write
        first, second = torch.ones(4000), torch.arange(4000, dtype=torch.float32)
        sw.swap_out("x0", first)
        sw.swap_out("x0", second)
        result = torch.zeros(4000)
        sw.swap_in("x0", result).wait()
        assert torch.equal(result, second)


def test_buffer_reuse_keeps_data_intact_and_neighbours_untouched(tmp_path: Path) -> None:
    settings = AioSettings(block_size=4096, queue_depth=1, thread_count=2)  # one staging buffer for everything
    tensors = {f"n{i}": torch.full((1024 * (i % 4) + 513,), float(i + 1)) for i in range(12)}
    with TensorSwapper(
        tmp_path, TensorSwapper.bytes_needed([t.nbytes for t in tensors.values()], settings), settings
    ) as sw:
        handles = [sw.swap_out(name, tensor) for name, tensor in tensors.items()]
        for handle in handles:
            handle.wait()
        sw.swap_out("n5", torch.full((1024 + 513,), -3.0)).wait()  # rewriting one slot leaves the others alone
        for name, tensor in tensors.items():
            out = torch.empty_like(tensor)
            sw.swap_in(name, out).wait()
            expected = torch.full_like(tensor, -3.0) if name == "n5" else tensor
            assert torch.equal(out, expected), name


def test_o_direct_probe_fallback_uses_buffered_io_with_fadvise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swapper_module, "probe_o_direct", lambda directory: False)
    advised: list[int] = []
    real_fadvise = os.posix_fadvise

    def recording_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append(advice)
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording_fadvise)
    with TensorSwapper(tmp_path, 1 << 20, SMALL_BLOCKS) as sw:
        assert sw.io_mode == "buffered+fadvise" and not sw.direct_io
        assert not fcntl.fcntl(sw._fd, fcntl.F_GETFL) & os.O_DIRECT
        tensor = _pattern(20000, torch.float32, seed=3)
        sw.swap_out("a", tensor).wait()
        out = torch.empty_like(tensor)
        sw.swap_in("a", out).wait()
        assert torch.equal(out, tensor)
    assert advised and set(advised) == {os.POSIX_FADV_DONTNEED}


def test_probe_result_decides_the_open_flags(tmp_path: Path) -> None:
    with TensorSwapper(tmp_path, 1 << 20) as sw:
        assert sw.direct_io == swapper_module.probe_o_direct(tmp_path)
        assert bool(fcntl.fcntl(sw._fd, fcntl.F_GETFL) & os.O_DIRECT) == sw.direct_io
        assert sw.io_mode == ("O_DIRECT" if sw.direct_io else "buffered+fadvise")


def test_filesystem_that_creates_then_refuses_o_direct_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems (tmpfs before Linux 6.6) create the file, then fail O_DIRECT with EINVAL: the probe file
    must not be left behind (the swapper removes its emptied job directory) and the swapper runs buffered."""
    real_open = os.open

    def create_then_refuse(path: object, flags: int, *args: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            os.close(real_open(path, flags & ~os.O_DIRECT, *args))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", create_then_refuse)
    with TensorSwapper(tmp_path, 1 << 16, SMALL_BLOCKS) as sw:
        assert not sw.direct_io and sw.io_mode == "buffered+fadvise"
        data = torch.arange(100, dtype=torch.float32)
        sw.swap_out("x", data).wait()
        assert torch.equal(sw.swap_in("x", torch.empty(100)).wait(), data)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_fails_at_start_with_sizes_and_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SwapSetupError) as caught:
        TensorSwapper(tmp_path, 5 * 2**30, job_id="big")
    message = str(caught.value)
    assert str(tmp_path / "big" / "swap.bin") in message
    assert str(5 * 2**30) in message and "free" in message
    assert list(tmp_path.iterdir()) == []  # the half-made job directory is gone
    assert deleted_files_held(tmp_path, "self") == {}  # and the unlinked file's descriptor is closed


def test_failed_file_creation_removes_the_job_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refuse_swap_file(path: object, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if str(path).endswith(swapper_module.SWAP_FILE_NAME):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)  # shutil.rmtree opens directories with dir_fd

    monkeypatch.setattr(os, "open", refuse_swap_file)
    with pytest.raises(SwapSetupError, match=r"cannot create the swap file .*job-x.*Permission denied"):
        TensorSwapper(tmp_path, 1 << 20, job_id="job-x")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_path_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_directory = tmp_path / "plain_file"
    not_a_directory.write_text("x")
    with pytest.raises(SwapSetupError, match=r"plain_file.*not usable"):
        TensorSwapper(not_a_directory, 1 << 20)

    def denied(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(SwapSetupError, match="Permission denied"):
        TensorSwapper(tmp_path / "ro", 1 << 20)


def test_nothing_is_left_under_nvme_path_and_close_frees_the_space(tmp_path: Path) -> None:
    sw = TensorSwapper(tmp_path, 1 << 20, job_id="job-a")
    assert list(tmp_path.iterdir()) == []  # no file, no job directory: the open descriptor is all there is
    assert not sw.path.exists() and not sw.directory.exists() and sw.path == tmp_path / "job-a" / "swap.bin"
    status = os.fstat(sw._fd)
    assert status.st_nlink == 0 and status.st_size == 1 << 20
    if _fallocate_allocates(tmp_path):
        assert status.st_blocks * 512 >= 1 << 20  # preallocated, although nameless
    assert list(deleted_files_held(tmp_path, "self").values()) == [f"{sw.path} (deleted)"]
    sw.swap_out("a", torch.arange(10, dtype=torch.float32)).wait()
    back = torch.empty(10)
    sw.swap_in("a", back).wait()
    assert torch.equal(back, torch.arange(10, dtype=torch.float32))
    again = TensorSwapper(tmp_path, 1 << 20, job_id="job-a")  # the job id's names are free again
    sw.close()
    assert list(deleted_files_held(tmp_path, "self").values()) == [f"{again.path} (deleted)"]  # only again's
    with pytest.raises(RuntimeError, match="closed"):
        sw.swap_out("a", torch.ones(10))
    sw.close()  # idempotent
    sw.abort()
    again.abort()
    again.abort()
    assert deleted_files_held(tmp_path, "self") == {}
    assert list(tmp_path.iterdir()) == []


def test_cleanup_on_exception_and_on_garbage_collection(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), TensorSwapper(tmp_path, 1 << 20, job_id="boom") as sw:
        sw.swap_out("a", torch.ones(100_000))
        assert len(deleted_files_held(tmp_path, "self")) == 1
        raise ZeroDivisionError
    assert deleted_files_held(tmp_path, "self") == {}
    dropped = TensorSwapper(tmp_path, 1 << 20, job_id="dropped")
    assert len(deleted_files_held(tmp_path, "self")) == 1
    del dropped
    gc.collect()
    assert deleted_files_held(tmp_path, "self") == {}
    assert list(tmp_path.iterdir()) == []


def test_io_error_surfaces_in_wait_and_close_still_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sw = TensorSwapper(tmp_path, 1 << 20, job_id="eio")

    def failing_pwrite(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.EIO, "simulated device error")

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    handle = sw.swap_out("a", torch.ones(5000))
    with pytest.raises(OSError, match="simulated device error"):
        handle.wait()
    with pytest.raises(OSError, match="simulated device error"):
        sw.close()
    assert deleted_files_held(tmp_path, "self") == {}
    assert list(tmp_path.iterdir()) == []


_KILLED_CHILD = """
import sys, time, torch
from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.swapper import TensorSwapper
swapper = TensorSwapper(sys.argv[1], int(sys.argv[2]), AioSettings(block_size=1 << 16, queue_depth=2, thread_count=1))
swapper.swap_out("x", torch.arange(300_000, dtype=torch.float32)).wait()
print("ready", swapper.capacity_bytes, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_swap_space_does_not_outlive_a_sigkilled_process(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup code: only an unlinked file guarantees the space goes with the process."""
    nvme_path, capacity = tmp_path / "nvme", 4 << 20
    env = {**os.environ, "PYTHONPATH": str(REPO_SRC), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _KILLED_CHILD, str(nvme_path), str(capacity)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[:1] == ["ready"], child.stderr.read() if child.stderr else ""
        assert int(line[1]) == capacity
        assert list(nvme_path.iterdir()) == []  # while it runs, nothing is there by name
        held = deleted_files_held(nvme_path, child.pid)
        assert len(held) == 1, held
        (link,) = held
        status = os.stat(link)  # the /proc link reaches the nameless file itself
        assert status.st_nlink == 0 and status.st_size == capacity
        if _fallocate_allocates(tmp_path):
            assert status.st_blocks * 512 >= capacity  # the preallocation is real disk space, accounted
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert list(nvme_path.iterdir()) == []


def test_synchronous_mode_and_bad_requests(tmp_path: Path) -> None:
    settings = AioSettings(block_size=4096, overlap_events=False)
    with TensorSwapper(tmp_path, 3 * 4096, settings) as sw:
        assert sw.swap_out("a", torch.ones(1000)).done()  # overlap_events=False: done on return
        with pytest.raises(KeyError, match="'missing'"):
            sw.swap_in("missing", torch.empty(3))
        with pytest.raises(ValueError, match="same byte size"):
            sw.swap_in("a", torch.empty(999))
        with pytest.raises(ValueError, match="1-D CPU tensor"):
            sw.swap_out("b", torch.ones(4, 4))
        with pytest.raises(ValueError, match="slot holds 4096"):
            sw.swap_out("a", torch.ones(2000))
        with pytest.raises(ValueError, match=r"is full.*bytes_needed"):
            sw.swap_out("c", torch.ones(3000))


def test_aio_settings_validation() -> None:
    assert AioSettings() == AioSettings(block_size=1 << 20, queue_depth=8, thread_count=1)
    with pytest.raises(ValueError, match=r"block_size = 1000.*page size"):
        AioSettings(block_size=1000)
    with pytest.raises(ValueError, match="thread_count = 0"):
        AioSettings(thread_count=0)
    assert AioSettings.from_mapping({"queue_depth": 4}).queue_depth == 4
    with pytest.raises(ValueError, match=r"aio.queue_dpeth is not an aio setting"):
        AioSettings.from_mapping({"queue_dpeth": 4})
    assert TensorSwapper.bytes_needed([1, 4096, 4097], AioSettings(block_size=4096)) == 4 * 4096


@pytest.mark.parametrize("direct_io", [True, False])
def test_aligned_tensors_skip_the_staging_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: bool
) -> None:
    if direct_io and not swapper_module.probe_o_direct(tmp_path):
        pytest.skip("filesystem refuses O_DIRECT")
    copies: list[int] = []
    real_memmove = swapper_module.ctypes.memmove

    def counting_memmove(destination: int, source: int, count: int) -> int:
        copies.append(count)
        return real_memmove(destination, source, count)

    monkeypatch.setattr(swapper_module.ctypes, "memmove", counting_memmove)
    settings = AioSettings(block_size=8192, queue_depth=2, thread_count=2)
    with TensorSwapper(tmp_path, 1 << 20, settings, direct_io=direct_io) as sw:
        source = aligned_empty(10 * 1024 + 5)  # 10 whole pages and a 20-byte tail
        assert source.data_ptr() % 4096 == 0
        source.copy_(_pattern(source.numel(), torch.float32, seed=9))
        sw.swap_out("a", source).wait()
        out = aligned_empty(source.numel())
        sw.swap_in("a", out).wait()
        assert torch.equal(out, source)
    # O_DIRECT stages only the 20-byte tail piece, once each way; buffered I/O stages nothing
    assert copies == ([20, 20] if direct_io else [])
