"""Background prefetch: read (and on CUDA, copy to the device) the next batch while the current one trains.

A single thread pulls batches from the source iterator in order and hands them over through a bounded queue.
On CUDA the host-to-device copy is issued with ``non_blocking=True`` on a side stream, from pinned memory, so
it overlaps with the compute stream; the consumer's stream waits on the copy's event before the batch is used.
On CPU there is nothing to copy: the batch is handed over as the DataLoader produced it.

Progress is reported when the consumer *receives* a batch (``on_delivered``), never when the thread reads
one, so a checkpoint taken at any moment points at the first batch the training loop has not seen.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

_POLL_SECONDS = 0.1


def move_to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Copy every tensor inside ``batch`` (nested tuples, lists, named tuples, dicts) to ``device``.

    Containers keep their type; anything that is not a tensor (ints, strings, None) passes through unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {key: move_to_device(value, device, non_blocking=non_blocking) for key, value in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:  # a Mapping whose constructor does not take a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(move_to_device(item, device, non_blocking=non_blocking) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device, non_blocking=non_blocking) for item in batch)
    return batch


def _tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors_in(value)
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors_in(item)


@dataclass
class _Ready:
    batch: Any
    copy_done: torch.cuda.Event | None


@dataclass
class _Failed:
    error: BaseException


class _End:
    pass


class _Producer:
    """The background thread's side. Kept apart from :class:`PrefetchIterator` so the running thread holds no
    reference to the iterator, which can then be garbage collected (and stop the thread) when abandoned."""

    def __init__(
        self, source: Iterator[Any], device: torch.device | None, out: queue.Queue, stop: threading.Event
    ) -> None:
        self._source = source
        self._device = device
        self._out = out
        self._stop = stop
        self._copy_stream = torch.cuda.Stream(device=device) if device is not None and device.type == "cuda" else None

    def run(self) -> None:
        try:
            for batch in self._source:
                if self._stop.is_set() or not self._put(self._prepare(batch)):
                    return
        except BaseException as error:  # handed to the consumer, who re-raises it
            self._put(_Failed(error))
            return
        self._put(_End())

    def _prepare(self, batch: Any) -> _Ready:
        if self._device is None or self._device.type == "cpu":
            return _Ready(batch, None)
        if self._copy_stream is None:  # another accelerator: a plain synchronous copy
            return _Ready(move_to_device(batch, self._device), None)
        with torch.cuda.stream(self._copy_stream):
            moved = move_to_device(batch, self._device, non_blocking=True)
            copy_done = torch.cuda.Event()
            copy_done.record(self._copy_stream)
        return _Ready(moved, copy_done)

    def _put(self, item: _Ready | _Failed | _End) -> bool:
        """Blocks until there is room; gives up (False) when the consumer closed the iterator."""
        while not self._stop.is_set():
            try:
                self._out.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False


class PrefetchIterator:
    """Iterates ``source`` one batch ahead in a daemon thread; see the module docstring.

    ``post_process`` (if given) maps each batch just before it reaches the consumer, while the sampler still
    stands at that batch; ``on_delivered`` is called after each batch reaches the consumer, ``on_exhausted`` once
    when the consumer reaches the end. An exception raised by the source is re-raised to the consumer at the position it
    happened. :meth:`close` stops the thread (also done when the iterator is garbage collected).
    """

    def __init__(
        self,
        source: Iterator[Any],
        *,
        device: torch.device | None,
        on_delivered: Callable[[], None] = lambda: None,
        on_exhausted: Callable[[], None] = lambda: None,
        depth: int = 1,
        post_process: Callable[[Any], Any] | None = None,
    ) -> None:
        self._device = device
        self._post_process = post_process
        self._on_delivered = on_delivered
        self._on_exhausted = on_exhausted
        self._queue: queue.Queue[_Ready | _Failed | _End] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        producer = _Producer(source, device, self._queue, self._stop)
        self._thread = threading.Thread(target=producer.run, name="shardspeed-prefetch", daemon=True)
        self._thread.start()

    # ---- consumer side ------------------------------------------------------------------------------
    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        item = self._get()
        if isinstance(item, _End):
            self._finished = True
            self._on_exhausted()
            raise StopIteration
        if isinstance(item, _Failed):
            self._finished = True
            raise item.error
        if item.copy_done is not None:
            compute_stream = torch.cuda.current_stream(self._device)
            compute_stream.wait_event(item.copy_done)
            # The tensors were allocated on the copy stream; tell the caching allocator they are now used on
            # the compute stream so their memory is not recycled while compute still reads it.
            for tensor in _tensors_in(item.batch):
                if tensor.is_cuda:
                    tensor.record_stream(compute_stream)
        batch = item.batch if self._post_process is None else self._post_process(item.batch)
        self._on_delivered()
        return batch

    def _get(self) -> _Ready | _Failed | _End:
        while True:
            try:
                return self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread stopped without delivering a batch") from None

    @property
    def read_ahead(self) -> int:
        """Batches read from the source but not yet delivered (what the thread has queued)."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop the background thread; the batches it has read ahead are discarded (not counted)."""
        self._stop.set()
        self._finished = True
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
