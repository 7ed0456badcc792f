"""``aio``: DeepSpeed's asynchronous NVMe I/O settings, used by NVMe offload (``offload_optimizer.device: nvme``).

The keys and defaults are DeepSpeed's. What each one means for shardspeed's thread-pool swapper is documented on
``shardspeed.offload.AioSettings``, which ``AioConfig.settings()`` builds (and which checks the page alignment of
``block_size``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ConfigModel, PositiveInt

if TYPE_CHECKING:
    from shardspeed.offload.aio_config import AioSettings


class AioConfig(ConfigModel):
    """``aio``: how NVMe swap files are read and written."""

    block_size: PositiveInt = 1_048_576
    """Bytes per I/O request (and per staging buffer); a multiple of the page size. DeepSpeed default: 1048576."""

    queue_depth: PositiveInt = 8
    """Requests in flight at once. DeepSpeed default: 8."""

    thread_count: PositiveInt = 1
    """Threads issuing reads and writes. DeepSpeed default: 1."""

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
