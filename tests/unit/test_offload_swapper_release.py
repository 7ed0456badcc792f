"""A finished swap no longer holds its tensor: once the caller drops it, its memory is freed (the swapper used
to keep every name's last tensor alive, which kept offloaded parameter shards in memory)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.swapper import TensorSwapper, aligned_empty


def test_finished_swaps_release_their_tensors(tmp_path: Path) -> None:
    settings = AioSettings(block_size=4096, queue_depth=4, thread_count=2)
    with TensorSwapper(tmp_path, TensorSwapper.bytes_needed([4 * 4096] * 2, settings), settings) as swapper:
        written = torch.arange(4096, dtype=torch.float32)
        swapper.swap_out("a", written).wait()
        read = torch.empty(4096)
        swapper.swap_in("a", read).wait()
        swapper.swap_out("b", torch.ones(4096)).wait()
        refs = [weakref.ref(written), weakref.ref(read)]
        assert torch.equal(read, written)
        del written, read
        gc.disable()  # freed by reference counting alone, not by a later garbage collection
        try:
            assert all(ref() is None for ref in refs)
        finally:
            gc.enable()
        back = torch.empty(4096)
        swapper.swap_in("a", back).wait()  # the data is still in the file
        assert torch.equal(back, torch.arange(4096, dtype=torch.float32))


def test_aligned_buffers_are_private_anonymous_memory() -> None:
    """Counted in RssAnon like any tensor (a shared mapping would show as RssShmem instead)."""
    buffer = aligned_empty(1 << 20)
    buffer.fill_(1.0)
    smaps = Path("/proc/self/smaps").read_text().split("\n")
    start = buffer.data_ptr()
    for i, line in enumerate(smaps):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            if low <= start < high:
                assert line.split()[1].endswith("p"), line  # rw-p: private
                anonymous = next(entry for entry in smaps[i:] if entry.startswith("Anonymous:"))
                assert int(anonymous.split()[1]) >= 4096, anonymous
                return
    raise AssertionError(f"no mapping holds {start:#x}")
