"""TensorSwapper: round trips, concurrency and ordering, O_DIRECT fallback, setup errors, cleanup."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
from pathlib import Path

import pytest
import torch

from shardspeed.offload import swapper as swapper_module
from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.swapper import SwapSetupError, TensorSwapper, aligned_empty

SMALL_BLOCKS = AioSettings(block_size=8192, queue_depth=2, thread_count=3)


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


def test_full_disk_fails_at_start_with_sizes_and_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SwapSetupError) as caught:
        TensorSwapper(tmp_path, 5 * 2**30, job_id="big")
    message = str(caught.value)
    assert str(tmp_path / "big" / "swap.bin") in message
    assert str(5 * 2**30) in message and "free" in message
    assert not (tmp_path / "big").exists()  # the half-made job directory is gone


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


def test_close_removes_job_directory_and_rejects_further_use(tmp_path: Path) -> None:
    sw = TensorSwapper(tmp_path, 1 << 20, job_id="job-a")
    assert (tmp_path / "job-a" / "swap.bin").stat().st_size == 1 << 20
    sw.swap_out("a", torch.ones(10)).wait()
    sw.close()
    assert not (tmp_path / "job-a").exists()
    with pytest.raises(RuntimeError, match="closed"):
        sw.swap_out("a", torch.ones(10))
    sw.close()  # idempotent


def test_cleanup_on_exception_and_on_garbage_collection(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), TensorSwapper(tmp_path, 1 << 20, job_id="boom") as sw:
        sw.swap_out("a", torch.ones(100_000))
        raise ZeroDivisionError
    assert not (tmp_path / "boom").exists()
    dropped = TensorSwapper(tmp_path, 1 << 20, job_id="dropped")
    assert (tmp_path / "dropped").exists()
    del dropped
    gc.collect()
    assert not (tmp_path / "dropped").exists()


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
    assert not (tmp_path / "eio").exists()


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
