"""Streaming Adam over chunks whose state lives in a store (NVMe swap file or host memory): ``stream_step``.

Each chunk keeps three tensors in the store (``STREAM_STATES``: its fp32 values and Adam's two moments); its
gradient is already in host memory. A step moves every chunk through host buffers: read it in, step it, write it
back. ``StreamPipeline`` says how much of that overlaps, from ``offload_optimizer``'s ``buffer_count``,
``pipeline_read`` and ``pipeline_write`` (``plan_pipeline``, a pure function):

- ``buffer_count`` counts chunk-sized fp32 host buffers. A chunk in flight takes one per streamed state, so the
  pipeline has ``buffer_count // 3`` *buffer sets* (DeepSpeed counts the gradient as a fourth buffer; ours stays
  where the reduction left it, so DeepSpeed's "at least 4 for Adam" is satisfied by any valid setting here).
- ``pipeline_write``: a chunk's write-back overlaps the following chunks' steps (needs a second set).
- ``pipeline_read``: chunks are read ahead while the current one is stepped, as far as free sets allow.

With 3 sets and both flags (the defaults here): read next ‖ step this ‖ write previous. A set is reused only after
the write-back of the chunk it held has finished, so the schedule is correct for any plan; ``stream_step`` never
holds more than ``buffer_sets`` chunks of state in host memory, whatever the number of chunks.

``ZeroUntilWritten`` wraps a store for ``fast_init``: moments that were never written read as zeros without I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from shardspeed.config.errors import ConfigError

from .aligned import aligned_empty
from .cpu_adam import Kernel, _check_hyperparameters, cpu_adamw_step
from .host_store import DoneHandle

STREAM_STATES: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq")
"""Per-chunk tensors ``stream_step`` keeps in the store (gradients arrive from memory)."""


class Handle(Protocol):
    def wait(self) -> torch.Tensor: ...


class Store(Protocol):
    """Named 1-D CPU tensors written and read asynchronously (``TensorSwapper`` or an in-memory store)."""

    def swap_out(self, name: str, tensor: torch.Tensor) -> Handle: ...

    def swap_in(self, name: str, out: torch.Tensor) -> Handle: ...


@dataclass
class StreamTimings:
    """Where ``stream_step``'s time went, summed over steps: blocked on reads, in CPU Adam, blocked on writes."""

    wait_read_s: float = 0.0
    adam_s: float = 0.0
    wait_write_s: float = 0.0


def state_key(chunk_name: str, state: str) -> str:
    """Store name of one state tensor of one chunk, e.g. ``"g0t1c0/exp_avg"``."""
    return f"{chunk_name}/{state}"


@dataclass(frozen=True)
class StreamPipeline:
    """How ``stream_step`` overlaps I/O with the step (see the module docstring)."""

    buffer_sets: int  # chunk-sized sets of host buffers, one per chunk in flight
    read_ahead: int  # chunks whose reads are started before the current chunk is stepped
    write_behind: bool  # whether a chunk's write-back overlaps later chunks' steps

    @property
    def host_buffers(self) -> int:
        """Chunk-sized fp32 buffers the stream allocates."""
        return self.buffer_sets * len(STREAM_STATES)


def plan_pipeline(buffer_count: int, pipeline_read: bool, pipeline_write: bool) -> StreamPipeline:
    """The overlap ``buffer_count`` chunk-sized buffers allow, restricted to what the two flags ask for."""
    per_chunk = len(STREAM_STATES)
    if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < per_chunk:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.buffer_count = {buffer_count!r}; valid: an int >= {per_chunk} "
            f"(each sub-group in flight needs {per_chunk} buffers: its fp32 values and Adam's two moments; "
            f"{3 * per_chunk} lets reading, stepping and writing overlap)"
        )
    sets = buffer_count // per_chunk
    write_behind = pipeline_write and sets >= 2
    free_for_reads = sets - 1 - (1 if write_behind else 0)  # one set is being stepped, one being written
    read_ahead = free_for_reads if pipeline_read else 0
    return StreamPipeline(sets, read_ahead, write_behind)


DEFAULT_PIPELINE = plan_pipeline(3 * len(STREAM_STATES), pipeline_read=True, pipeline_write=True)


def init_stream_state(store: Store, chunk_name: str, param_chunk: torch.Tensor) -> list[Handle]:
    """Write a chunk's starting state: its values and zero moments (what Adam starts from)."""
    zeros = torch.zeros_like(param_chunk)
    return [
        store.swap_out(state_key(chunk_name, "param"), param_chunk),
        store.swap_out(state_key(chunk_name, "exp_avg"), zeros),
        store.swap_out(state_key(chunk_name, "exp_avg_sq"), zeros),
    ]


class ZeroUntilWritten:
    """``fast_init``: ``names`` read as zeros (no I/O) until first written; everything else goes to ``store``.

    Without it, starting an NVMe-offloaded optimizer writes every chunk's zero moments to disk (two thirds of the
    state) and the first step reads them back; with it, only the values are written at start."""

    def __init__(self, store: Store, names: set[str]) -> None:
        self.store, self.unwritten = store, set(names)

    def swap_out(self, name: str, tensor: torch.Tensor) -> Handle:
        self.unwritten.discard(name)
        return self.store.swap_out(name, tensor)

    def swap_in(self, name: str, out: torch.Tensor) -> Handle:
        if name in self.unwritten:
            out.zero_()
            return DoneHandle(out)  # type: ignore[return-value]
        return self.store.swap_in(name, out)

    def __getattr__(self, attribute: str) -> object:  # flush, close, names, ... of the wrapped store
        return getattr(self.store, attribute)


def stream_step(
    store: Store,
    names: Sequence[str],
    grads: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    on_chunk_done: Callable[[int, torch.Tensor], None] | None = None,
    kernel: Kernel = "auto",
    pipeline: StreamPipeline = DEFAULT_PIPELINE,
    read_grad: Callable[[int, torch.Tensor], Handle] | None = None,
    grad_scale: float = 1.0,
    timings: StreamTimings | None = None,
) -> None:
    """One optimizer step over chunks whose state lives in ``store``, overlapped as ``pipeline`` says.

    ``names[i]`` names chunk i (its state under ``state_key(names[i], s)`` for s in ``STREAM_STATES``, e.g. from
    ``init_stream_state``); ``grads[i]`` is its gradient, in memory. ``on_chunk_done(i, param)`` runs right after
    chunk i is updated, before it is written back (where updated values go back to the stepped tensor).
    Host memory: ``pipeline.buffer_sets`` sets of three chunk-sized buffers, whatever the number of chunks.

    ``read_grad(i, out)``: gradients in the store too (grad_swap.py): ``grads[i]`` then only gives chunk i's size,
    and its gradient is read into a fourth buffer of the set with its states (read ahead alike), then multiplied
    by ``grad_scale`` (clip coefficient, fp16 unscale) once it is in memory.
    """
    if len(names) != len(grads):
        raise ValueError(f"names has {len(names)} chunks but grads has {len(grads)}; one gradient per chunk")
    if not names:
        return
    _check_hyperparameters(step, lr, betas, eps, weight_decay)
    sets = min(pipeline.buffer_sets, len(names))  # never more sets than chunks
    largest = max(grad.numel() for grad in grads)
    per_set = len(STREAM_STATES) + (1 if read_grad is not None else 0)
    buffer_sets = [[aligned_empty(largest, torch.float32) for _ in range(per_set)] for _ in range(sets)]
    reads: list[list[Handle]] = [[] for _ in names]
    writes: list[list[Handle]] = [[] for _ in names]
    next_read = 0

    def start_reads(upto: int) -> None:
        nonlocal next_read
        while next_read <= min(upto, len(names) - 1):
            index, buffers = next_read, buffer_sets[next_read % sets]
            if index >= sets:
                for handle in writes[index - sets]:
                    handle.wait()  # this set still holds chunk index-sets until its write-back ends
            numel = grads[index].numel()
            reads[index] = [
                store.swap_in(state_key(names[index], state), buffer[:numel])
                for state, buffer in zip(STREAM_STATES, buffers)
            ]
            if read_grad is not None:
                reads[index].append(read_grad(index, buffers[len(STREAM_STATES)][:numel]))
            next_read += 1

    clock = timings if timings is not None else StreamTimings()
    for index in range(len(names)):
        began = time.perf_counter()
        start_reads(index)
        for handle in reads[index]:
            handle.wait()
        start_reads(index + pipeline.read_ahead)
        clock.wait_read_s += time.perf_counter() - began
        began = time.perf_counter()
        numel = grads[index].numel()
        param, exp_avg, exp_avg_sq = (buffer[:numel] for buffer in buffer_sets[index % sets][: len(STREAM_STATES)])
        if read_grad is None:
            grad = grads[index].view(-1)
        else:
            grad = buffer_sets[index % sets][len(STREAM_STATES)][:numel]
            if grad_scale != 1.0:
                grad.mul_(grad_scale)
        cpu_adamw_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            chunk_numel=max(numel, 1),
            kernel=kernel,
        )
        if on_chunk_done is not None:
            on_chunk_done(index, param)
        clock.adam_s += time.perf_counter() - began
        writes[index] = [
            store.swap_out(state_key(names[index], state), tensor)
            for state, tensor in zip(STREAM_STATES, (param, exp_avg, exp_avg_sq))
        ]
        if not pipeline.write_behind:
            began = time.perf_counter()
            for handle in writes[index]:
                handle.wait()
            clock.wait_write_s += time.perf_counter() - began
    began = time.perf_counter()
    for handles in writes:
        for handle in handles:
            handle.wait()
    clock.wait_write_s += time.perf_counter() - began
