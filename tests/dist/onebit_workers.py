"""N simulated workers in one process for the optimizer-owned-communication tests: the single-process reference.

Each worker runs its own optimizer instance in a thread; their ``MeanComm`` calls meet at a barrier and one
thread computes the mean for all of them — exact means summed in rank order, compressed means with
``compression.reference.compressed_allreduce`` and one worker/server error pair per (key, worker), as the ranks
keep theirs. The optimizer code under test is the same code the ranks run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardspeed.compression import reference
from shardspeed.compression.signs import padded_numel


class _Hub:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world
        self.results: list[Any] = [None] * world
        self.errors: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def meet(self, rank: int, value: Any, combine: Callable[[list[Any]], list[Any]]) -> Any:
        self.slots[rank] = value
        if self.barrier.wait() == 0:
            self.results = combine(list(self.slots))
        self.barrier.wait()
        return self.results[rank]


class SimulatedComm:
    """One worker's ``MeanComm`` view of the hub."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world

    def exact_mean(self, tensors: list[torch.Tensor]) -> None:
        def combine(all_lists: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
            means = []
            for parts in zip(*all_lists, strict=True):
                total = parts[0].clone()
                for part in parts[1:]:
                    total += part
                means.append(total / self.world)
            return [means] * self.world

        for t, m in zip(tensors, self.hub.meet(self.rank, tensors, combine), strict=True):
            t.copy_(m)

    def compressed_mean(self, key: str, tensor: torch.Tensor) -> None:
        def combine(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            n = inputs[0].numel()
            if key not in self.hub.errors:
                padded = padded_numel(n, self.world)
                self.hub.errors[key] = (
                    [torch.zeros(padded) for _ in range(self.world)],
                    [torch.zeros(padded // self.world) for _ in range(self.world)],
                )
            we, se = self.hub.errors[key]
            flat = [x.detach().reshape(-1).float().clone() for x in inputs]
            return [reference.compressed_allreduce(flat, we, se)] * self.world

        tensor.copy_(self.hub.meet(self.rank, tensor, combine).view_as(tensor))

    def compressed_means(self, key: str, tensors: list[torch.Tensor]) -> None:
        for i, tensor in enumerate(tensors):  # each compressed apart, its own errors: the partwise call's math
            self.compressed_mean(f"{key}.{i}", tensor)

    def reset_errors(self) -> None:
        def combine(_: list[Any]) -> list[Any]:
            for we, se in self.hub.errors.values():
                for e in (*we, *se):
                    e.zero_()
            return [None] * self.world

        self.hub.meet(self.rank, None, combine)

    def errors_state_dict(self) -> dict[str, Any]:
        return {}

    def load_errors_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def simulate(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    params: list[torch.Tensor],
    grads: Callable[[int, int, torch.optim.Optimizer], list[torch.Tensor]],
    world: int,
    steps: int,
) -> list[list[list[torch.Tensor]]]:
    """Parameters after every step, per worker: ``history[step][rank][i]``. ``grads(step, rank, opt)`` is what
    the worker's optimizer receives at that step (local gradients, or the engine's mean in a warm-up)."""
    hub = _Hub(world)
    history: list[list[Any]] = [[None] * world for _ in range(steps)]
    failures: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            live = [torch.nn.Parameter(t.clone()) for t in params]
            opt = make_optimizer(live)
            opt.bind_comm(SimulatedComm(hub, rank))  # type: ignore[attr-defined]
            for step in range(steps):
                for p, g in zip(live, grads(step, rank, opt), strict=True):
                    p.grad = g.clone()
                opt.step()
                history[step][rank] = [p.detach().clone() for p in live]
        except BaseException as exc:
            failures.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return history


def exact_grads(seed: int, shapes: tuple[tuple[int, ...], ...], step: int, rank: int) -> list[torch.Tensor]:
    """A rank's local gradients at ``step``: multiples of 1/64, so every mean is exact in any summation order
    (gloo's order and the reference's agree bit for bit)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    return [torch.round(torch.randn(*s, generator=gen) * 64 * (1 + i % 3)) / 64 for i, s in enumerate(shapes)]


def feed(seed: int, shapes: tuple[tuple[int, ...], ...], world: int) -> Callable[..., list[torch.Tensor]]:
    """What the engine hands the optimizer: local gradients while it owns communication, else the exact mean."""

    def grads(step: int, rank: int, opt: Any) -> list[torch.Tensor]:
        if opt.owns_communication:
            return exact_grads(seed, shapes, step, rank)
        per_rank = [exact_grads(seed, shapes, step, r) for r in range(world)]
        return [sum(parts[1:], parts[0].clone()) / world for parts in zip(*per_rank, strict=True)]

    return grads


@contextlib.contextmanager
def shardspeed_messages(level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages shardspeed's logger emits at ``level`` or above inside the block, as a list filled in place."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=level)
    logging.getLogger("shardspeed").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)


def load_with_warnings(config: dict, ckpt: str) -> tuple[Any, list[str]]:
    """A fresh engine on the parity model with ``ckpt`` loaded, and the warnings shardspeed logged meanwhile (the
    error-buffer reset at another world size is one)."""
    from parity import make_model

    import shardspeed

    with shardspeed_messages() as records:
        engine, *_ = shardspeed.initialize(model=make_model(), config=config)
        engine.load_checkpoint(ckpt)
    return engine, records
