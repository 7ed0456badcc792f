"""Error-fed 1-bit collectives over one mesh axis, built from ``all_to_all_single`` + ``all_gather`` only, so they
run on every backend (gloo, NCCL); all communication goes through ``Collectives`` (logged, failure board, order
check). The math is in ``compression/signs.py`` ([Note: 1-bit compression]); ``compression/reference.py`` runs
the same algorithms for N simulated workers in one process.

[Note: compressed all-reduce] DeepSpeed's ``compressed_allreduce`` (runtime/comm/compressed.py, 0.19.6), as a
two-level scheme over N ranks, every element's mean computed by one "server" rank:
1. worker: pad the fp32 input to ``padded_numel`` (DeepSpeed's size), add the worker error, one scale for the whole
   buffer, keep the new worker error; the signs, packed, form N chunks of ``padded / N / 8`` bytes.
2. ``all_to_all_single`` of the packed chunks (rank j receives everyone's chunk j) + ``all_gather`` of the N
   worker scales (fp32).
3. server: rank j decompresses its N copies of chunk j and averages them (``average_chunks``), adds its server
   error, compresses the result again (one scale for the chunk), keeps the new server error.
4. ``all_gather`` of the server chunks' packed signs + ``all_gather`` of the N server scales; every rank
   decompresses the same bytes, so every rank holds the identical result.
Per rank the traffic is ~2 × (N−1)/N × n/8 bytes plus 2 × (N−1) × 4 bytes of scales: 1/32 of an fp32 ring
all-reduce (2 (N−1)/N × 4n), whatever N. The compressed reduce-scatter stops after step 2: the owner of each slice
keeps the fp32 mean of the N decompressed copies (worker error only), for ZeRO's sharded optimizer states.

[Note: compressed work] Step 3 needs step 2's data, so ``launch`` issues steps 1–2 asynchronously and the returned
Work runs 3–4 inside ``wait()``. Step 4's collectives are thus issued at the ``wait()`` call, a point every rank
reaches in the same program order; ``done()`` stays False until then (issuing step 4 from a poll could order it
differently on different ranks and mismatch collectives).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from shardspeed.comm.collectives import Collectives
from shardspeed.comm.work import Work
from shardspeed.compression.signs import average_chunks, compress_, padded_numel, unpack_signs
from shardspeed.topology import AxisGroup


class _ChainedWork(Work):
    """Phase-one Works plus the rest of the algorithm, run once in ``wait()`` ([Note: compressed work])."""

    def __init__(self, first: list[Work], then: Callable[[], None], keep: tuple[Tensor, ...] = ()) -> None:
        super().__init__(None)
        self._first, self._then = first, then
        self._keep = keep  # phase one's inputs, alive until it has finished (gloo reads them async)

    def wait(self) -> None:
        while self._first:
            self._first[0].wait()
            self._first.pop(0)
        self._keep = ()
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def done(self) -> bool:
        return self._then is None


def _check_input(what: str, tensor: Tensor, numel: int) -> None:
    if tensor.numel() != numel or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(
            f"{what}: expected a contiguous float32 tensor of {numel} elements, got {tensor.dtype} "
            f"{tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )


class _ErrorFed:
    """Error buffers (named) with state_dict / load_state_dict / reset / error_bytes. The state also carries
    ``meta`` = [numel, axis size]: buffer shapes alone do not identify the layout (a reduce-scatter's worker error
    is often the same size at every world size while its chunks differ)."""

    _errors: dict[str, Tensor]
    numel: int
    axis: AxisGroup

    @property
    def error_bytes(self) -> int:
        """Bytes held by the error buffers (0 on an axis of size 1)."""
        return sum(e.numel() * e.element_size() for e in self._errors.values())

    def _meta(self) -> Tensor:
        return torch.tensor([self.numel, self.axis.size], dtype=torch.int64)

    def state_dict(self) -> dict[str, Tensor]:
        return {"meta": self._meta(), **{name: e.clone() for name, e in self._errors.items()}}

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Restore error buffers saved by a collective of the same size and axis size; a mismatch (``meta``, then
        the key set and shapes) raises and names it: at another world size, reset() instead."""
        if set(sd) != {"meta", *self._errors}:
            raise ValueError(
                f"{type(self).__name__}: state keys {sorted(sd)} != expected {sorted({'meta', *self._errors})}"
            )
        saved = [int(v) for v in sd["meta"].reshape(-1).tolist()]
        if saved != [self.numel, self.axis.size]:
            raise ValueError(
                f"{type(self).__name__}: error buffers saved for [numel, axis size] = {saved}, this one is "
                f"{[self.numel, self.axis.size]} (saved at another size or axis size: reset() the buffers instead)"
            )
        for name, error in self._errors.items():
            if sd[name].shape != error.shape:
                raise ValueError(
                    f"{type(self).__name__}: {name} has shape {tuple(sd[name].shape)}, expected {tuple(error.shape)} "
                    "(saved at another size or axis size: reset() the buffers instead)"
                )
            error.copy_(sd[name])

    def reset(self) -> None:
        for error in self._errors.values():
            error.zero_()


class CompressedAllReduce(_ErrorFed):
    """The mean of a flat fp32 tensor of ``numel`` elements over ``axis``, error-fed 1-bit ([Note: compressed
    all-reduce]). Holds a worker error of the padded size and a server error of one chunk. Exact (no compression,
    no communication) on an axis of size 1."""

    def __init__(
        self, numel: int, axis: AxisGroup, collectives: Collectives, *, device: torch.device, tag: str = "compressed"
    ) -> None:
        self.numel, self.axis, self.collectives, self.device, self.tag = numel, axis, collectives, device, tag
        n = axis.size
        self.padded = padded_numel(numel, n) if n > 1 else numel
        self.chunk = self.padded // n
        self.worker_error = torch.zeros(self.padded if n > 1 else 0, device=device)
        self.server_error = torch.zeros(self.chunk if n > 1 else 0, device=device)
        self._errors = {"worker_error": self.worker_error, "server_error": self.server_error}

    def __call__(self, tensor: Tensor) -> None:
        self.launch(tensor).wait()

    def launch(self, tensor: Tensor) -> Work:
        """Start the all-reduce of ``tensor`` (in place); the result is there once the Work is waited. The Work's
        ``done()`` stays False until ``wait()`` (phase two is issued there, [Note: compressed work]): never poll
        it, wait it, in the same program order on every rank."""
        _check_input("CompressedAllReduce", tensor, self.numel)
        n, c = self.axis.size, self.collectives
        if n == 1:
            return Work(None)
        buffer = torch.zeros(self.padded, device=self.device)
        buffer[: self.numel] = tensor.reshape(-1)
        packed, scale = compress_(buffer, self.worker_error)
        received, scales = torch.empty_like(packed), torch.empty(n, device=self.device)
        first = [
            c.all_to_all_single(received, packed, self.axis, async_op=True, tag=self.tag),
            c.all_gather(scales, scale, self.axis, async_op=True, tag=self.tag),
        ]
        return _ChainedWork(first, lambda: self._serve(tensor, received, scales), keep=(packed, scale))

    def _serve(self, tensor: Tensor, received: Tensor, scales: Tensor) -> None:
        """Steps 3-4: average this rank's chunk, compress it with the server error, gather every rank's."""
        n, c = self.axis.size, self.collectives
        mean = average_chunks(received.view(n, -1), scales, self.chunk)
        packed, scale = compress_(mean, self.server_error)
        gathered = torch.empty(n * packed.numel(), dtype=torch.uint8, device=self.device)
        server_scales = torch.empty(n, device=self.device)
        works = [
            c.all_gather(gathered, packed, self.axis, async_op=True, tag=self.tag),
            c.all_gather(server_scales, scale, self.axis, async_op=True, tag=self.tag),
        ]
        for work in works:
            work.wait()
        out = unpack_signs(gathered, self.padded).view(n, -1).mul_(server_scales.view(n, 1))
        tensor.view(-1).copy_(out.view(-1)[: self.numel])


class CompressedReduceScatter(_ErrorFed):
    """This rank's slice of the mean over ``axis`` of a flat fp32 tensor of ``numel`` elements (``numel`` divisible
    by the axis size; slice i = elements [i·numel/N, (i+1)·numel/N)), error-fed 1-bit on the way in, the owner's
    mean kept in fp32 (worker error only). Each slice is padded to a whole number of bytes. Exact on an axis of
    size 1."""

    def __init__(
        self, numel: int, axis: AxisGroup, collectives: Collectives, *, device: torch.device, tag: str = "compressed"
    ) -> None:
        n = axis.size
        if numel % n:
            raise ValueError(f"CompressedReduceScatter: {numel} elements do not split over the {axis.name} axis' {n}")
        self.numel, self.axis, self.collectives, self.device, self.tag = numel, axis, collectives, device, tag
        self.slice = numel // n
        self.chunk = -(-self.slice // 8) * 8
        self.worker_error = torch.zeros(n * self.chunk if n > 1 else 0, device=device)
        self._errors = {"worker_error": self.worker_error}

    def __call__(self, shard: Tensor, unsharded: Tensor) -> None:
        self.launch(shard, unsharded).wait()

    def launch(self, shard: Tensor, unsharded: Tensor) -> Work:
        """Start the reduce-scatter; ``shard`` holds this rank's slice of the mean once the Work is waited. The
        Work's ``done()`` stays False until ``wait()`` ([Note: compressed work]): never poll it, wait it."""
        _check_input("CompressedReduceScatter (shard)", shard, self.slice)
        _check_input("CompressedReduceScatter (unsharded)", unsharded, self.numel)
        n, c = self.axis.size, self.collectives
        if n == 1:
            shard.view(-1).copy_(unsharded.view(-1))
            return Work(None)
        buffer = torch.zeros(n, self.chunk, device=self.device)
        buffer[:, : self.slice] = unsharded.view(n, self.slice)
        packed, scale = compress_(buffer.view(-1), self.worker_error)
        received, scales = torch.empty_like(packed), torch.empty(n, device=self.device)
        first = [
            c.all_to_all_single(received, packed, self.axis, async_op=True, tag=self.tag),
            c.all_gather(scales, scale, self.axis, async_op=True, tag=self.tag),
        ]

        def own() -> None:
            shard.view(-1).copy_(average_chunks(received.view(n, -1), scales, self.slice))

        return _ChainedWork(first, own, keep=(packed, scale))
