"""Gradients in the optimizer's swap file (offload/grad_swap.py) and the stream sizing rule (offload/disk_probe.py,
[Note: stream sizing]), without processes: the grad keys' accounting, zeros for chunks never written, deferred
I/O failures, the streamed step reading gradients from the store equal to reading them from memory, the swap file
sized for the fourth key, and the pure sizing rule with the config's explicit keys winning."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from shardspeed.config.offload import OffloadOptimizerConfig
from shardspeed.offload import AioSettings, TensorSwapper
from shardspeed.offload.chunks import Chunk, chunk_bounds
from shardspeed.offload.disk_probe import (
    MAX_READ_AHEAD,
    MAX_WINDOW,
    MIN_WINDOW,
    DiskRates,
    measure,
    size_stream,
    sized_offload_config,
)
from shardspeed.offload.grad_swap import GradSwap
from shardspeed.offload.host_store import DoneHandle, HostStore
from shardspeed.offload.optimizer import StreamedAdam
from shardspeed.offload.stream import init_stream_state, plan_pipeline, stream_step

SMALL_AIO = AioSettings(block_size=4096, queue_depth=4, thread_count=2)
MIB = 1 << 20


def _chunks(tensor: torch.Tensor, chunk: int, prefix: str = "g0t0") -> list[Chunk]:
    return [Chunk(f"{prefix}c{s}", tensor, s, e) for s, e in chunk_bounds(tensor.numel(), chunk)]


def test_grad_keys_accounting_and_zeros_for_chunks_not_written(tmp_path: Path) -> None:
    a, b = torch.zeros(50), torch.zeros(7)
    table = {id(a): _chunks(a, 16), id(b): _chunks(b, 16, "g0t1")}
    with TensorSwapper(tmp_path, 1 << 20, SMALL_AIO) as store:
        swap = GradSwap(store, table, window_bytes=1 << 20)
        grad = torch.arange(50, dtype=torch.float32)
        swap.write(a, grad)
        assert swap.written == {"g0t0c0", "g0t0c16", "g0t0c32", "g0t0c48"}
        assert swap.bytes_written == 200 and swap.has(a) and not swap.has(b)
        assert sorted(n for n in store.names) == sorted(f"{c}/grad" for c in swap.written)  # keys next to states
        out = torch.full((50,), -1.0)
        for handle in swap.read_into(a, out):
            handle.wait()
        assert torch.equal(out, grad) and swap.bytes_read == 200
        other = torch.full((7,), -1.0)
        assert isinstance(swap.read(table[id(b)][0], other), DoneHandle)  # never written: zeros, no I/O
        assert torch.equal(other, torch.zeros(7)) and swap.bytes_read == 200
        swap.forget(["g0t0c16"])
        part = torch.full((16,), -1.0)
        swap.read(table[id(a)][1], part).wait()
        assert torch.equal(part, torch.zeros(16))  # forgotten: reads as a zeroed gradient
        swap.forget()
        assert swap.written == set() and not swap.has(a)
        swap.raise_failure()  # nothing failed: no-op
        assert swap.in_flight_bytes == 0


def test_write_behind_window_retires_oldest_writes(tmp_path: Path) -> None:
    tensors = [torch.zeros(1024) for _ in range(4)]
    table = {id(t): _chunks(t, 1024, f"g0t{i}") for i, t in enumerate(tensors)}
    with TensorSwapper(tmp_path, 1 << 20, SMALL_AIO) as store:
        swap = GradSwap(store, table, window_bytes=2 * 4096)
        for t in tensors:
            swap.write(t, torch.ones(1024))
            assert swap.in_flight_bytes <= 2 * 4096  # past the window the oldest writes are waited for
        assert swap.peak_in_flight_bytes <= 3 * 4096 and swap.bytes_written == 4 * 4096
        swap.drain()
        assert swap.in_flight_bytes == 0


class _FailingHandle:
    def wait(self) -> torch.Tensor:
        raise OSError(errno.ENOSPC, "No space left on device (writing 'g0t0c0/grad')")

    def done(self) -> bool:
        return True


class _FullStore(HostStore):
    def swap_out(self, name: str, tensor: torch.Tensor):  # type: ignore[no-untyped-def]
        return _FailingHandle()


def test_io_failures_outside_the_step_are_deferred_to_it() -> None:
    t = torch.zeros(8)
    swap = GradSwap(_FullStore(pin_memory=False), {id(t): _chunks(t, 8)}, window_bytes=1)
    swap.write(t, torch.ones(8))  # the failing write is retired (waited) without raising
    swap.write(t, torch.ones(8))
    assert isinstance(swap.failure, OSError) and swap.failure.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left on device"):
        swap.raise_failure()
    assert swap.failure is None  # raised once


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_stream_step_reading_gradients_from_the_store_equals_gradients_in_memory(scale: float) -> None:
    torch.manual_seed(0)
    values, grads = torch.randn(100), torch.randn(100)
    tensor = torch.zeros(100)
    chunks = _chunks(tensor, 32)
    names = [c.name for c in chunks]
    results = []
    for from_store in (False, True):
        store = HostStore(pin_memory=False)
        for c in chunks:
            for handle in init_stream_state(store, c.name, values[c.start : c.end].clone()):
                handle.wait()
        if from_store:
            swap = GradSwap(store, {id(tensor): chunks}, window_bytes=MIB)
            swap.write(tensor, grads.clone())
            swap.scale *= scale
            sizes = [c.of(tensor) for c in chunks]
            stream_step(
                store,
                names,
                sizes,
                step=1,
                lr=0.1,
                weight_decay=0.01,
                read_grad=lambda i, out, swap=swap: swap.read(chunks[i], out),
                grad_scale=swap.scale,
            )
        else:
            scaled = grads.clone()
            if scale != 1.0:
                torch._foreach_mul_([scaled], scale)  # what Stage3States.scale_grads does in memory
            stream_step(store, names, [c.of(scaled) for c in chunks], step=1, lr=0.1, weight_decay=0.01)
        out = torch.empty(100)
        for c in chunks:
            store.swap_in(f"{c.name}/param", out[c.start : c.end])
        results.append(out)
    assert torch.equal(results[0], results[1])


def test_swap_file_sized_for_the_gradient_key() -> None:
    inner = torch.optim.AdamW([torch.zeros(100, requires_grad=True), torch.zeros(7, requires_grad=True)])
    without = StreamedAdam.bytes_needed(inner, 32, SMALL_AIO)
    with_grads = StreamedAdam.bytes_needed(inner, 32, SMALL_AIO, grads=True)
    assert without == 3 * 5 * 4096 and with_grads == 4 * 5 * 4096  # 5 chunks, one block-rounded slot per key


def test_sizing_rule_cpu_bound_reads_one_ahead() -> None:
    # a 1 TB/s disk, Adam at 1e8 elements/s, 1M-element chunks: t_io = 28n / 1e12 ≈ 29 µs < t_adam ≈ 10 ms
    fast_disk = DiskRates(read_bps=1e12, write_bps=1e12, adam_eps=1e8)
    sizing = size_stream(fast_disk, 1 << 20, grads_in_store=True)
    assert sizing.read_ahead == 1 and sizing.buffer_count == 9 and not sizing.disk_bound
    assert sizing.grad_window_bytes == MAX_WINDOW  # 0.1 s of a 1 TB/s disk, clamped


def test_sizing_rule_disk_bound_queues_the_ratio_capped() -> None:
    n = 1 << 20
    # t_io = 4n·4/r + 12n/w with r = w = 28n bytes/s → exactly 1 s; Adam at 0.4 s per chunk → ratio 2.5 → 3
    rates = DiskRates(read_bps=28 * n, write_bps=28 * n, adam_eps=n / 0.4)
    sizing = size_stream(rates, n, grads_in_store=True)
    assert sizing.disk_bound and sizing.read_ahead == 3 and sizing.buffer_count == (3 + 2) * 3
    assert sizing.grad_window_bytes == MIN_WINDOW  # 0.1 s of a 29 MB/s disk, clamped up
    assert size_stream(DiskRates(1e9, 1e9, 1e9), n, True).grad_window_bytes == int(1e8)  # 0.1 s of 1 GB/s
    slow = size_stream(DiskRates(read_bps=1e3, write_bps=1e3, adam_eps=1e9), n, grads_in_store=False)
    assert slow.read_ahead == MAX_READ_AHEAD and slow.grad_window_bytes == MIN_WINDOW
    plan = plan_pipeline(sizing.buffer_count, True, True)
    assert plan.read_ahead == sizing.read_ahead and plan.write_behind  # what the stream then does
    with pytest.raises(ValueError, match="positive"):
        size_stream(DiskRates(0, 1, 1), n, True)


def test_explicit_config_keys_win_over_the_measurement() -> None:
    sizing = size_stream(DiskRates(1e3, 1e3, 1e9), 1 << 20, grads_in_store=True)
    default = sized_offload_config(OffloadOptimizerConfig(device="nvme", nvme_path="/tmp"), sizing)
    assert default.buffer_count == sizing.buffer_count and default.pipeline_read and default.pipeline_write
    explicit = OffloadOptimizerConfig(device="nvme", nvme_path="/tmp", buffer_count=4, pipeline_write=False)
    kept = sized_offload_config(explicit, sizing)
    assert kept.buffer_count == 4 and not kept.pipeline_write and kept.pipeline_read
    assert sized_offload_config(explicit, None) is explicit


def test_measure_is_cached_per_directory(tmp_path: Path) -> None:
    first = measure(tmp_path)
    assert first is not None and first.read_bps > 0 and first.write_bps > 0 and first.adam_eps > 0
    assert measure(tmp_path) is first and list(tmp_path.iterdir()) == []  # the probe file is gone


def test_write_behind_window_capped_at_two_stepped_tensors() -> None:
    fast = DiskRates(read_bps=1e10, write_bps=1e10, adam_eps=1e9)
    assert size_stream(fast, 1 << 20, True).grad_window_bytes == MAX_WINDOW
    assert size_stream(fast, 1 << 20, True, largest_tensor_bytes=100 * MIB).grad_window_bytes == 200 * MIB
    assert size_stream(fast, 1 << 20, True, largest_tensor_bytes=MIB).grad_window_bytes == MIN_WINDOW
