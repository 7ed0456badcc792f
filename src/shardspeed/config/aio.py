"""``aio``: DeepSpeed's asynchronous NVMe I/O settings, used by NVMe offload (``offload_optimizer.device: nvme``).

The keys are DeepSpeed's. Two defaults differ on purpose: ``block_size`` 4 MiB (DeepSpeed: 1 MiB) and
``thread_count`` 2 (DeepSpeed: 1). DeepSpeed's defaults suit libaio's kernel queue; shardspeed's swapper issues
positional reads/writes from a thread pool, and on this project's machines 1 MiB requests from one thread reached
only 0.57x (write) / 0.27x (read) of the disk's sequential bandwidth, while 4 MiB from two threads reached
1.13x / 0.93x (benchmarks/bench_offload.py). Performance only: numerics never depend on them.

What each key means for shardspeed's thread-pool swapper is documented on
``shardspeed.offload.AioSettings``, which ``AioConfig.settings()`` builds (and which checks the page alignment of
``block_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from .base import ConfigModel, PositiveInt

if TYPE_CHECKING:
    from shardspeed.offload.aio_config import AioSettings


class AioConfig(ConfigModel):
    """``aio``: how NVMe swap files are read and written."""

    KEY_ALIASES: ClassVar[Mapping[str, str]] = {"intra_op_parallelism": "thread_count"}
    """DeepSpeed's newer name for ``thread_count`` (both are read; 0.19 documents ``intra_op_parallelism``)."""

    block_size: PositiveInt = 4 * 1_048_576
    """Bytes per I/O request (and per staging buffer); a multiple of the page size. Default 4 MiB (DeepSpeed:
    1048576; see the module docstring)."""

    queue_depth: PositiveInt = 8
    """Requests in flight at once. DeepSpeed default: 8."""

    thread_count: PositiveInt = 2
    """Threads issuing reads and writes. Default 2 (DeepSpeed: 1; see the module docstring)."""

    single_submit: bool = False
    """Submit a tensor's requests one after another instead of spreading them. DeepSpeed default: false."""

    overlap_events: bool = True
    """Let swap operations overlap the caller (return before the I/O ends). DeepSpeed default: true."""

    def settings(self) -> AioSettings:
        """The swapper's settings for this section."""
        from shardspeed.offload.aio_config import AioSettings

        return AioSettings(
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            thread_count=self.thread_count,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
        )
