"""``offload_param``'s tuning keys as pure pieces: the ``max_in_cpu`` split of units between host memory and NVMe,
the shard buffer pool (reuse, bound, overflow), the prefetch-depth hint, and the build-time checks."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness import deleted_files_held
from shardspeed.config import load_config
from shardspeed.config.errors import ConfigError
from shardspeed.offload.aio_config import PAGE_SIZE, AioSettings
from shardspeed.offload.host_store import HostStore
from shardspeed.zero.stage3.param_offload import (
    ShardBufferPool,
    build_param_offloader,
    shards_in_flight,
    split_by_max_in_cpu,
)


# --- max_in_cpu ----------------------------------------------------------------------------------------------
def test_split_keeps_the_leading_units_that_fit() -> None:
    assert split_by_max_in_cpu([10, 20, 5, 30], 30) == [True, True, False, False]  # 10 + 20 = 30 fits exactly
    assert split_by_max_in_cpu([10, 20, 5, 30], 29) == [True, False, False, False]
    # 5 would fit in the 50 - 10 left after the first unit, but placement stays one leading block
    assert split_by_max_in_cpu([10, 60, 5], 50) == [True, False, False]


def test_split_extremes() -> None:
    assert split_by_max_in_cpu([10, 20], 0) == [False, False]  # 0: everything to NVMe
    assert split_by_max_in_cpu([10, 20], 1_000_000_000) == [True, True]  # DeepSpeed's default: all in memory
    assert split_by_max_in_cpu([], 5) == []


# --- prefetch depth hint -------------------------------------------------------------------------------------
def test_shards_in_flight_follows_the_prefetch_window() -> None:
    numels, swapped = [100, 100, 100, 100], [True] * 4
    assert shards_in_flight(numels, swapped, 0, 10**9) == 1  # no prefetch: one unit gathered at a time
    assert shards_in_flight(numels, swapped, 200, 10**9) == 2  # two units ahead fit the budget
    assert shards_in_flight(numels, swapped, 10**9, 10**9) == 3  # everything after the first unit
    assert shards_in_flight(numels, swapped, 10**9, 250) == 1  # max_live: current + one more = 200, + 1 = 300
    assert shards_in_flight(numels, [True, False, False, True], 10**9, 10**9) == 1  # kept units use no buffer


# --- the pool ------------------------------------------------------------------------------------------------
def test_pool_reuses_released_buffers() -> None:
    pool = ShardBufferPool(2, 1000)
    first = pool.acquire(300, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and first.numel() == 300
    assert first.data_ptr() % PAGE_SIZE == 0  # O_DIRECT reads into it in place
    first.copy_(torch.arange(300, dtype=torch.bfloat16))
    address = first.data_ptr()
    pool.release(first)
    again = pool.acquire(250, torch.float32)  # any dtype whose bytes fit
    assert again.data_ptr() == address and pool.allocated == 1 and pool.allocated_bytes == 1000
    assert again.dtype == torch.float32 and again.numel() == 250


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """Warnings the shardspeed logger emits inside the block (a handler of its own: an engine built earlier in
    this process may have set the logger not to propagate)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardspeed")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def test_pool_is_bounded_and_overflow_counts_and_warns_once() -> None:
    pool = ShardBufferPool(2, 4096, suggested_count=3)
    a, b = pool.acquire(1024, torch.float32), pool.acquire(1000, torch.float32)
    assert a.data_ptr() != b.data_ptr() and pool.allocated_bytes == 2 * 4096
    with _warnings() as warnings:
        c = pool.acquire(1024, torch.float32)
        d = pool.acquire(10, torch.float32)
    assert pool.overflows == 2 and pool.allocated_bytes == 2 * 4096  # temporaries are not pool memory
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr()) and c.data_ptr() % PAGE_SIZE == 0
    assert len(warnings) == 1, warnings
    assert "buffer_count = 2" in warnings[0] and "at least 3" in warnings[0], warnings[0]
    pool.release(c)  # a temporary: dropped, the pool does not grow
    pool.release(d)
    pool.release(a)
    assert pool.acquire(8, torch.float32).data_ptr() == a.data_ptr() and pool.overflows == 2
    assert pool.peak_in_use == 2


def test_pool_suggests_more_than_in_use_when_the_hint_is_low() -> None:
    pool = ShardBufferPool(1, 64, suggested_count=0)
    pool.acquire(16, torch.float32)
    with _warnings() as warnings:
        pool.acquire(16, torch.float32)
    assert len(warnings) == 1 and "at least 2" in warnings[0], warnings


def test_pool_rejects_a_shard_larger_than_its_buffers() -> None:
    with pytest.raises(ValueError, match="exceed"):
        ShardBufferPool(1, 64).acquire(17, torch.float32)


# --- deferred release after asynchronous host-to-device copies -----------------------------------------------
class _FakeCopy:
    """Stands in for the ``torch.cuda.Event`` recorded after a non-blocking copy out of a pool buffer: the copy
    is still running until ``finish`` (or ``synchronize``, which waits for it) is called."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0
        self.waited = False

    def finish(self) -> None:
        self.done = True

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_pool_does_not_reuse_a_buffer_before_its_copy_completed() -> None:
    pool = ShardBufferPool(2, 4096)
    first = pool.acquire(1024, torch.float32)
    copy = _FakeCopy()
    pool.release_after(first, copy)  # a copy to the device still reads ``first``
    assert pool.pending == 1 and pool.in_use == 1
    second = pool.try_acquire(1024, torch.float32)
    assert second is not None and second.data_ptr() != first.data_ptr() and pool.allocated == 2
    assert pool.try_acquire(1024, torch.float32) is None  # read-ahead never waits for a copy
    assert copy.queries >= 2 and not copy.waited and pool.overflows == 0
    copy.finish()
    third = pool.try_acquire(1024, torch.float32)  # the copy completed: its buffer is free again
    assert third is not None and third.data_ptr() == first.data_ptr()
    assert pool.pending == 0 and pool.allocated == 2 and not copy.waited and pool.waited_copies == 0


def test_pool_waits_for_a_copy_rather_than_overflowing() -> None:
    pool = ShardBufferPool(1, 4096)
    first = pool.acquire(1024, torch.float32)
    copy = _FakeCopy()
    pool.release_after(first, copy)
    again = pool.acquire(1024, torch.float32)  # every buffer handed out, one only waiting for its copy
    assert copy.waited and again.data_ptr() == first.data_ptr()
    assert pool.overflows == 0 and pool.waited_copies == 1 and pool.pending == 0


def test_pool_keeps_a_temporary_buffer_alive_until_its_copy_completed() -> None:
    pool = ShardBufferPool(1, 4096)
    held = pool.acquire(1024, torch.float32)
    temporary = pool.acquire(1024, torch.float32)  # an overflow buffer
    copy = _FakeCopy()
    pool.release_after(temporary, copy)
    assert pool.pending == 1  # referenced here, so its memory outlives the copy
    pool.release(held)
    assert pool.acquire(8, torch.float32).data_ptr() == held.data_ptr() and not copy.waited
    copy.finish()
    pool.acquire(8, torch.float32)  # collects it (a temporary: dropped, the pool does not grow)
    assert pool.pending == 0 and pool.allocated == 1


def test_closing_the_offloader_waits_for_pending_copies(tmp_path: Path) -> None:
    offloader = _build(tmp_path, _units([1000]))
    assert offloader.pool is not None and not offloader.pool.pin  # CPU units: nothing to pin
    buffer = offloader.pool.acquire(1000, torch.bfloat16)
    copy = _FakeCopy()
    offloader.pool.release_after(buffer, copy)
    offloader.close()
    assert copy.waited and offloader.pool.pending == 0 and offloader.pool.in_use == 0


def test_pool_is_pinned_for_cuda_units(tmp_path: Path) -> None:
    units = _units([1000])
    units[0].device = torch.device("cuda", 0)  # nothing is allocated on it: the pool allocates on first acquire
    offloader = _build(tmp_path, units)
    assert offloader.pool is not None and offloader.pool.pin
    offloader.close()


def test_host_store_hands_out_the_tensor_it_holds() -> None:
    """The offloader copies a shard kept in host memory to the device straight from the stored tensor (no
    staging copy, non-blocking when pinned): ``held`` is that tensor, and a missing name is a named error."""
    store = HostStore(pin_memory=False)
    store.swap_out("unit3", torch.arange(6, dtype=torch.float32))
    held = store.held("unit3")
    assert torch.equal(held, torch.arange(6, dtype=torch.float32))
    store.swap_out("unit3", torch.ones(6))  # rewritten in place: the same tensor, so nothing else ever reuses it
    assert store.held("unit3").data_ptr() == held.data_ptr() and torch.equal(held, torch.ones(6))
    with pytest.raises(KeyError, match="unit4"):
        store.held("unit4")


# --- build-time checks and the swap-file size ----------------------------------------------------------------
def _units(shard_numels: list[int], dtype: torch.dtype = torch.bfloat16) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            index=i,
            name=f"layer{i}",
            names=[f"layer{i}.weight"],
            shard_numel=n,
            numel=2 * n,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        for i, n in enumerate(shard_numels)
    ]


def _build(tmp: Path, units: list, **knobs: int):
    settings = AioSettings(block_size=4096, queue_depth=2, thread_count=1)
    return build_param_offloader(
        units, "nvme", nvme_path=str(tmp), pin_memory=False, settings=settings, rank=0, agree=lambda o: [o], **knobs
    )


def test_buffer_size_below_a_shard_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        _build(tmp_path, _units([100, 3000, 50]), buffer_size=2999)
    message = str(error.value)
    for part in ("offload_param.buffer_size = 2999", "'layer1'", "'layer1.weight'", "3000", "at least 3000"):
        assert part in message, message
    assert not deleted_files_held(tmp_path)  # failed before any swap file was opened
    # the same shard kept in host memory by max_in_cpu needs no buffer
    offloader = _build(tmp_path, _units([100, 3000, 50]), buffer_size=100, max_in_cpu=3100)
    assert offloader.in_cpu_units == {0, 1} and offloader.swap_file_bytes == 4096
    offloader.close()


def test_buffer_count_zero_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"buffer_count = 0; valid: at least 1"):
        _build(tmp_path, _units([100]), buffer_count=0)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"offload_param": {"buffer_count": 0}}}
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_count"):
        load_config(config, dp_world_size=1)


def test_swap_file_holds_only_the_nvme_units(tmp_path: Path) -> None:
    units = _units([1000, 3000, 2049, 5])  # bf16: 2000, 6000, 4098, 10 bytes
    offloader = _build(tmp_path, units, max_in_cpu=1000)
    assert offloader.in_cpu_units == {0} and offloader.in_cpu_bytes == 2000
    assert offloader.swap_file_bytes == 4096 * (2 + 2 + 1)  # each NVMe shard in whole 4096-byte blocks
    assert offloader.pool is not None and offloader.pool.buffer_bytes == 3000 * 2  # the largest NVMe shard
    offloader.close()
    nothing_to_disk = _build(tmp_path, units, max_in_cpu=10**9)
    assert nothing_to_disk.store is None and nothing_to_disk.pool is None and nothing_to_disk.swap_file_bytes == 0
    assert nothing_to_disk.in_cpu_bytes == 2 * (1000 + 3000 + 2049 + 5)
    assert not deleted_files_held(tmp_path)  # no swap file was opened
