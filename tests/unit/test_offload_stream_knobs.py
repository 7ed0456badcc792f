"""``offload_optimizer``'s tuning keys: ``buffer_count`` + ``pipeline_read``/``pipeline_write`` (the stream's
overlap and host-buffer bound), ``fast_init`` (zero moments never written at start) and ``ratio`` (part of the
state kept on the training device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspeed.config import ConfigError
from shardspeed.config.offload import OffloadOptimizerConfig
from shardspeed.offload import AioSettings, TensorSwapper
from shardspeed.offload.chunks import offloaded_mask
from shardspeed.offload.host_store import HostStore
from shardspeed.offload.optimizer import StreamedAdam
from shardspeed.offload.stream import STREAM_STATES, StreamPipeline, plan_pipeline

SMALL_AIO = AioSettings(block_size=4096, queue_depth=4, thread_count=2)
SIZES = (50, 7, 130)
CHUNK = 16


class RecordingStore(HostStore):
    """A host store that records every call: (operation, name, buffer address, bytes)."""

    def __init__(self) -> None:
        super().__init__(pin_memory=False)
        self.events: list[tuple[str, str, int, int]] = []

    def swap_out(self, name: str, tensor: torch.Tensor):  # type: ignore[no-untyped-def]
        self.events.append(("out", name, tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return super().swap_out(name, tensor)

    def swap_in(self, name: str, out: torch.Tensor):  # type: ignore[no-untyped-def]
        self.events.append(("in", name, out.data_ptr(), out.numel() * out.element_size()))
        return super().swap_in(name, out)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in SIZES]


def _train(offload: OffloadOptimizerConfig | None, store: object = None, steps: int = 3) -> tuple[list, object]:
    """AdamW over ``_tensors()``: plain torch (``offload`` None) or streamed through ``store``."""
    tensors = _tensors()
    inner = torch.optim.AdamW(
        [{"params": tensors[:2], "weight_decay": 0.1}, {"params": tensors[2:], "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    optimizer = inner if offload is None else StreamedAdam(inner, store, CHUNK, offload=offload)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for t in tensors:
            t.grad = torch.randn(t.numel(), generator=g)
        optimizer.step()
    return tensors, optimizer


def _assert_matches_torch(got: list[torch.Tensor]) -> None:
    expected, _ = _train(None)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------ pipeline plan


@pytest.mark.parametrize("read", [False, True])
@pytest.mark.parametrize("write", [False, True])
@pytest.mark.parametrize("buffer_count", range(3, 40))
def test_pipeline_plan_never_needs_more_buffers_than_given(buffer_count: int, read: bool, write: bool) -> None:
    plan = plan_pipeline(buffer_count, read, write)
    assert plan.host_buffers <= buffer_count and plan.buffer_sets == buffer_count // 3
    # one set is stepped, one (if writes overlap) is being written, the rest may be read ahead
    assert 1 + plan.read_ahead + int(plan.write_behind) <= plan.buffer_sets
    assert plan.read_ahead == 0 or read
    assert plan.write_behind == (write and plan.buffer_sets >= 2)


def test_pipeline_plan_named_cases() -> None:
    assert plan_pipeline(9, True, True) == StreamPipeline(3, 1, True)  # read next ‖ step ‖ write previous
    assert plan_pipeline(4, True, True) == StreamPipeline(1, 0, False)  # DeepSpeed's default count: sequential
    assert plan_pipeline(6, True, True) == StreamPipeline(2, 0, True)
    assert plan_pipeline(6, True, False) == StreamPipeline(2, 1, False)
    assert plan_pipeline(15, True, True) == StreamPipeline(5, 3, True)
    with pytest.raises(ConfigError, match=r"offload_optimizer.buffer_count = 2; valid: an int >= 3"):
        plan_pipeline(2, True, True)


PLANS = [(3, True, True), (6, True, True), (9, True, True), (9, False, False), (12, True, False), (30, True, True)]


@pytest.mark.parametrize(("buffer_count", "read", "write"), PLANS)
def test_stream_respects_the_buffer_bound_and_matches_torch(buffer_count: int, read: bool, write: bool) -> None:
    offload = OffloadOptimizerConfig(buffer_count=buffer_count, pipeline_read=read, pipeline_write=write)
    store = RecordingStore()
    got, _ = _train(offload, store)
    _assert_matches_torch(got)
    plan = plan_pipeline(buffer_count, read, write)
    reads = [address for op, _, address, _ in store.events if op == "in"]
    groups = [name.split("t", 1)[0] for op, name, _, _ in store.events if op == "in"]  # "g0t0c16/param" → "g0"
    per_step = 3 * sum(-(-n // CHUNK) for n in SIZES)  # every chunk's three states, once per step
    assert len(reads) == 3 * per_step
    for step in range(3):  # within one group's stream the buffers are reused, never more than planned
        window = range(step * per_step, (step + 1) * per_step)
        # (per group: each group's stream allocates its own buffers, and whether the allocator hands the next group
        # the same addresses is its business — counting across groups made this test depend on that)
        for group in {groups[i] for i in window}:
            assert len({reads[i] for i in window if groups[i] == group}) <= plan.host_buffers
    if plan.buffer_sets == 1:  # sequential: a chunk is read only after the previous one was written back
        order = [(op, name.split("/")[0]) for op, name, _, _ in store.events if "param" in name]
        steps = order[len(order) - 2 * len([o for o in order if o[0] == "in"]) :]
        assert all(steps[i][0] == "in" and steps[i + 1][0] == "out" for i in range(0, len(steps), 2))


# ------------------------------------------------------------------------------------------------ fast_init


def test_fast_init_writes_only_values_and_trains_identically() -> None:
    slow, fast = RecordingStore(), RecordingStore()
    StreamedAdam(torch.optim.AdamW(_tensors()), slow, CHUNK)
    StreamedAdam(torch.optim.AdamW(_tensors()), fast, CHUNK, offload=OffloadOptimizerConfig(fast_init=True))
    chunks = sum(-(-n // CHUNK) for n in SIZES)
    assert len(slow.events) == 3 * chunks and {name.split("/")[1] for _, name, _, _ in slow.events} == set(
        STREAM_STATES
    )
    assert len(fast.events) == chunks and all(name.endswith("/param") for _, name, _, _ in fast.events)
    assert sum(b for *_, b in fast.events) * 3 == sum(b for *_, b in slow.events)  # a third of the start-up bytes

    store = RecordingStore()
    got, optimizer = _train(OffloadOptimizerConfig(fast_init=True), store)
    _assert_matches_torch(got)
    first_step_reads = [name for op, name, _, _ in store.events if op == "in"][: 3 * chunks]
    assert all(name.endswith("/param") for name in first_step_reads[:chunks])
    # after a step every moment was written: a fresh read goes to the store
    assert not optimizer.store.unwritten  # type: ignore[attr-defined]


def test_fast_init_state_before_any_step_reads_as_zeros(tmp_path: Path) -> None:
    tensors = _tensors()
    inner = torch.optim.AdamW(tensors)
    swapper = TensorSwapper(tmp_path, StreamedAdam.bytes_needed(inner, CHUNK, SMALL_AIO), SMALL_AIO)
    optimizer = StreamedAdam(inner, swapper, CHUNK, offload=OffloadOptimizerConfig(fast_init=True))
    state = optimizer.state.get(tensors[2])
    assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    optimizer.close()


# ------------------------------------------------------------------------------------------------ ratio


def test_offloaded_mask_takes_whole_chunks_from_the_front() -> None:
    assert offloaded_mask([10, 10, 10, 10], 1.0) == [True] * 4
    assert offloaded_mask([10, 10, 10, 10], 0.0) == [False] * 4
    assert offloaded_mask([10, 10, 10, 10], 0.5) == [True, True, False, False]
    assert offloaded_mask([10, 10, 10, 10], 0.51) == [True, True, True, False]  # rounds up to whole chunks
    assert offloaded_mask([30, 5, 5], 0.1) == [True, False, False]
    assert offloaded_mask([], 0.5) == []


@pytest.mark.parametrize("ratio", [0.0, 0.4, 1.0])
def test_ratio_keeps_the_rest_on_the_device_and_matches_torch(tmp_path: Path, ratio: float) -> None:
    offload = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), ratio=ratio)
    store = RecordingStore()
    got, optimizer = _train(offload, store)
    _assert_matches_torch(got)
    sizes = [min(CHUNK, n - s) for n in SIZES for s in range(0, n, CHUNK)]
    mask = offloaded_mask(sizes, ratio)
    offloaded = sum(size for size, m in zip(sizes, mask) if m)
    stored = {name: b for op, name, _, b in store.events if op == "out"}
    assert sum(stored.values()) == 3 * 4 * offloaded  # values + two moments, fp32, of the offloaded chunks only
    assert optimizer.resident_state_bytes == 2 * 4 * (sum(SIZES) - offloaded)  # type: ignore[attr-defined]
    # the swap file is sized for the offloaded part alone
    inner = torch.optim.AdamW(_tensors())
    expected = TensorSwapper.bytes_needed([4 * s for s, m in zip(sizes, mask) if m for _ in range(3)], SMALL_AIO)
    assert StreamedAdam.bytes_needed(inner, CHUNK, SMALL_AIO, ratio) == max(expected, 1)


def test_ratio_state_reads_and_loads_across_both_homes() -> None:
    tensors, streamed = _train(OffloadOptimizerConfig(ratio=0.3), RecordingStore())
    reference, torch_opt = _train(None)
    for t, r in zip(tensors, reference):
        ours, theirs = streamed.state.get(t), torch_opt.state[r]  # type: ignore[attr-defined]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours[key], theirs[key].view(-1), atol=1e-6, rtol=0)
    entry = streamed.state[tensors[2]]  # type: ignore[attr-defined]  # spans offloaded and resident chunks
    entry["exp_avg"].copy_(torch.arange(130, dtype=torch.float32))
    streamed.after_checkpoint_load()  # type: ignore[attr-defined]
    assert torch.equal(streamed.state.get(tensors[2])["exp_avg"], torch.arange(130, dtype=torch.float32))  # type: ignore[attr-defined]
