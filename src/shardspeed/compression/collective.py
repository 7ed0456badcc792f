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
from shardspeed.compression.signs import BLOCK, average_rows_, compress_compensated_, padded_numel, unpack_scaled_
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


def unpack_range_(out: Tensor, start: int, chunk: int, packed: Tensor, scales: Tensor, index: Tensor) -> None:
    """``out`` <- elements ``[start, start + out.numel())`` of a compressed result whose rank r's ``chunk`` elements
    are ``packed[r]`` (``chunk / 8`` bytes, rows may be strided) decompressed with ``scales[r]``: the whole bytes are
    gathered straight into ``out``, a partial byte at either end goes through an 8-element buffer."""
    end = start + out.numel()
    for r in range(start // chunk, -(-end // chunk)):
        lo, hi = max(start, r * chunk), min(end, (r + 1) * chunk)
        lo8, hi8 = -(-lo // 8) * 8, hi // 8 * 8
        if hi8 > lo8:
            first = lo8 // 8 - r * chunk // 8
            cut = packed[r, first : first + (hi8 - lo8) // 8]
            unpack_scaled_(cut, scales[r], out[lo8 - start : hi8 - start], index[: cut.numel()])
        for a, b in ((lo, min(lo8, hi)), (max(lo8, hi8), hi)):  # the head and tail bytes' elements
            if b > a:  # a partial byte: unpack it whole, keep the needed elements
                byte, last = a // 8 - r * chunk // 8, torch.empty(8, device=out.device)
                unpack_scaled_(packed[r, byte : byte + 1], scales[r], last)
                out[a - start : b - start].copy_(last[a % 8 : a % 8 + b - a])


class _ErrorFed:
    """Error buffers (named) with state_dict / load_state_dict / reset / error_bytes. The state also carries
    ``meta`` = [numel, axis size]: buffer shapes alone do not identify the layout (a reduce-scatter's worker error
    is often the same size at every world size while its chunks differ)."""

    _errors: dict[str, Tensor]
    numel: int
    axis: AxisGroup
    _meta_fields = "[numel, axis size]"  # what ``_meta`` lists, for the load error

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
        saved, expected = [int(v) for v in sd["meta"].reshape(-1).tolist()], self._meta().tolist()
        if saved != expected:
            raise ValueError(
                f"{type(self).__name__}: error buffers saved for {self._meta_fields} = {saved}, this one is "
                f"{expected} (saved at another size or axis size: reset() the buffers instead)"
            )
        for name, error in self._errors.items():
            if sd[name].shape != error.shape:
                raise ValueError(
                    f"{type(self).__name__}: {name} has shape {tuple(sd[name].shape)}, expected {tuple(error.shape)} "
                    "(saved at another size or axis size: reset() the buffers instead)"
                )
            error.copy_(sd[name]).add_(0.0)  # -0.0 -> +0.0: [Note: no negative zero] in compression/signs.py

    def reset(self) -> None:
        for error in self._errors.values():
            error.zero_()


class Workspace:
    """Element-wise work buffers (sign bools, float rows, gather indices) that compressed collectives use only
    while the host runs their math, never while bytes are in flight: one optimizer's collectives (one per
    parameter, several launched before any is waited) share one, so their number does not multiply this memory.
    Each buffer grows to the largest request and is kept ([Note: compressed hot path])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The first ``numel`` elements of the buffer ``name`` (contents undefined)."""
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self._buffers[(name, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


class _Scratch:
    """The buffers one compressed collective reuses on every call ([Note: compressed hot path]): allocated on the
    first call, kept (fresh multi-megabyte temporaries cost page faults on every call on CPU). The wire buffers
    are the instance's own (they are in flight between launch and wait); the work buffers come from the shared
    ``Workspace``, fetched at each use."""

    def __init__(self, padded: int, n: int, workspace: Workspace) -> None:
        nbytes, device = padded // 8, workspace.device
        self.packed = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.received = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.scales = torch.empty(n, device=device)
        self.server_scales = torch.empty(n, device=device)
        self._padded, self._n, self._workspace = padded, n, workspace

    @property
    def bits(self) -> Tensor:
        return self._workspace.get("bits", min(self._padded, BLOCK), torch.bool)

    @property
    def floats(self) -> Tensor:
        """copysign scratch, then the server's rows"""
        return self._workspace.get("floats", min(self._padded, self._n * BLOCK))

    @property
    def index(self) -> Tensor:
        return self._workspace.get("index", self._padded // 8, torch.int32)

    def rows(self, n: int) -> Tensor:
        """The server's (N, block) rows, in the float scratch."""
        return self.floats.view(n, -1)

    @property
    def nbytes(self) -> int:
        """The instance's own wire buffers (the shared work buffers: ``Workspace.nbytes``)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.received, self.scales, self.server_scales))


class CompressedAllReduce(_ErrorFed):
    """The mean of a flat fp32 tensor of ``numel`` elements over ``axis``, error-fed 1-bit ([Note: compressed
    all-reduce]). Holds a worker error of the padded size and a server error of one chunk. Exact (no compression,
    no communication) on an axis of size 1.

    [Note: compressed hot path] On CPU the element-wise work, not the bytes, bounds a compressed call, so each step
    makes as few passes over the bucket as it can, into buffers kept across calls (``scratch_bytes``): the input is
    added into the worker error buffer in place (that buffer is the compensated input; the new error overwrites
    it), the signs are packed from one bool pass (one int64 multiply per 8 signs), the server's N copies are
    unpacked by one table gather each straight into ±scale_r / N and reduced by one ``sum(0)``, and the result is
    gathered straight into the caller's tensor. The float operations and their order are DeepSpeed's, so the
    results (and error buffers) equal ``compression/reference.py`` and DeepSpeed 0.19.6 bit for bit."""

    def __init__(
        self,
        numel: int,
        axis: AxisGroup,
        collectives: Collectives,
        *,
        device: torch.device,
        tag: str = "compressed",
        workspace: Workspace | None = None,
    ) -> None:
        self.numel, self.axis, self.collectives, self.device, self.tag = numel, axis, collectives, device, tag
        self.workspace = workspace or Workspace(device)
        n = axis.size
        self.padded = padded_numel(numel, n) if n > 1 else numel
        self.chunk = self.padded // n
        self.worker_error = torch.zeros(self.padded if n > 1 else 0, device=device)
        self.server_error = torch.zeros(self.chunk if n > 1 else 0, device=device)
        self._errors = {"worker_error": self.worker_error, "server_error": self.server_error}
        self._scratch: _Scratch | None = None

    @property
    def scratch_bytes(self) -> int:
        """Bytes of this instance's reused wire buffers (allocated at the first call; not state, not checkpointed);
        the work buffers it shares are ``workspace.nbytes``."""
        return 0 if self._scratch is None else self._scratch.nbytes

    def __call__(self, tensor: Tensor) -> None:
        self.launch(tensor).wait()

    def launch(self, tensor: Tensor) -> Work:
        """Start the all-reduce of ``tensor`` (in place); the result is there once the Work is waited. One call in
        flight per instance (the buffers are reused). The Work's ``done()`` stays False until ``wait()`` (phase two
        is issued there, [Note: compressed work]): never poll it, wait it, in the same program order on every
        rank."""
        _check_input("CompressedAllReduce", tensor, self.numel)
        return self._launch([tensor.view(-1)])

    def launch_parts(self, parts: list[Tensor]) -> Work:
        """``launch`` for a bucket given as pieces (e.g. each parameter's momentum), ``numel`` elements in all, in
        order: each piece is added into the error buffer where the flat bucket would hold it and receives its part
        of the mean, so the caller needs no flat copy (one pass less each way)."""
        total = sum(p.numel() for p in parts)
        if total != self.numel or any(not p.is_floating_point() for p in parts):
            raise ValueError(
                f"CompressedAllReduce.launch_parts: {total} floating elements given, expected {self.numel}"
            )
        return self._launch(parts)

    def _launch(self, parts: list[Tensor]) -> Work:
        n, c = self.axis.size, self.collectives
        if n == 1:
            return Work(None)
        if self._scratch is None:
            self._scratch = _Scratch(self.padded, n, self.workspace)
        s = self._scratch
        offset = 0
        for part in parts:  # padding: zeros + error = error
            self.worker_error[offset : offset + part.numel()].add_(part.reshape(-1))
            offset += part.numel()
        scale = compress_compensated_(self.worker_error, s.packed, s.bits, s.floats)
        first = [
            c.all_to_all_single(s.received, s.packed, self.axis, async_op=True, tag=self.tag),
            c.all_gather(s.scales, scale, self.axis, async_op=True, tag=self.tag),
        ]
        return _ChainedWork(first, lambda: self._serve(parts, scale))

    def _serve(self, parts: list[Tensor], worker_scale: Tensor) -> None:
        """Steps 3-4: average this rank's chunk, compress it with the server error, gather every rank's."""
        n, c, s, chunk = self.axis.size, self.collectives, self._scratch, self.chunk
        assert s is not None
        # the mean, and the server error += mean (DeepSpeed's mean + server error), in one blocked sweep
        mean = self.workspace.get("mean", chunk)
        average_rows_(s.received.view(n, -1), s.scales, s.rows(n), mean, s.index, add_to=self.server_error)
        cb = chunk // 8
        own = s.packed[:cb]  # the worker's packed signs went out in phase one: reuse the bytes
        scale = compress_compensated_(self.server_error, own, s.bits[:chunk], s.floats[:chunk])
        works = [
            c.all_gather(s.received, own, self.axis, async_op=True, tag=self.tag),
            c.all_gather(s.server_scales, scale, self.axis, async_op=True, tag=self.tag),
        ]
        for work in works:
            work.wait()
        del worker_scale  # kept alive until here: gloo read it during phase one
        packed, offset = s.received.view(n, cb), 0
        for part in parts:  # straight into each piece where it is a contiguous fp32 tensor
            direct = part.dtype == torch.float32 and part.is_contiguous()
            dest = part.view(-1) if direct else torch.empty(part.numel(), device=self.device)
            unpack_range_(dest, offset, chunk, packed, s.server_scales, s.index)
            if not direct:
                part.copy_(dest.view_as(part))
            offset += part.numel()


class CompressedReduceScatter(_ErrorFed):
    """This rank's slice of the mean over ``axis`` of a flat fp32 tensor of ``numel`` elements (``numel`` divisible
    by the axis size; slice i = elements [i·numel/N, (i+1)·numel/N)), error-fed 1-bit on the way in, the owner's
    mean kept in fp32 (worker error only). Each slice is padded to a whole number of bytes. Exact on an axis of
    size 1."""

    def __init__(
        self,
        numel: int,
        axis: AxisGroup,
        collectives: Collectives,
        *,
        device: torch.device,
        tag: str = "compressed",
        workspace: Workspace | None = None,
    ) -> None:
        n = axis.size
        if numel % n:
            raise ValueError(f"CompressedReduceScatter: {numel} elements do not split over the {axis.name} axis' {n}")
        self.numel, self.axis, self.collectives, self.device, self.tag = numel, axis, collectives, device, tag
        self.workspace = workspace or Workspace(device)
        self.slice = numel // n
        self.chunk = -(-self.slice // 8) * 8
        self.worker_error = torch.zeros(n * self.chunk if n > 1 else 0, device=device)
        self._errors = {"worker_error": self.worker_error}
        self._scratch: _Scratch | None = None

    @property
    def scratch_bytes(self) -> int:
        """Bytes of this instance's reused wire buffers (allocated at the first call; not state, not checkpointed);
        the work buffers it shares are ``workspace.nbytes``."""
        return 0 if self._scratch is None else self._scratch.nbytes

    def __call__(self, shard: Tensor, unsharded: Tensor) -> None:
        self.launch(shard, unsharded).wait()

    def launch(self, shard: Tensor, unsharded: Tensor) -> Work:
        """Start the reduce-scatter; ``shard`` holds this rank's slice of the mean once the Work is waited. One call
        in flight per instance (the buffers are reused: [Note: compressed hot path]). The Work's ``done()`` stays
        False until ``wait()`` ([Note: compressed work]): never poll it, wait it."""
        _check_input("CompressedReduceScatter (shard)", shard, self.slice)
        _check_input("CompressedReduceScatter (unsharded)", unsharded, self.numel)
        n, c = self.axis.size, self.collectives
        if n == 1:
            shard.view(-1).copy_(unsharded.view(-1))
            return Work(None)
        if self._scratch is None:
            self._scratch = _Scratch(n * self.chunk, n, self.workspace)
        s = self._scratch
        self.worker_error.view(n, self.chunk)[:, : self.slice].add_(unsharded.view(n, self.slice))
        scale = compress_compensated_(self.worker_error, s.packed, s.bits, s.floats)
        first = [
            c.all_to_all_single(s.received, s.packed, self.axis, async_op=True, tag=self.tag),
            c.all_gather(s.scales, scale, self.axis, async_op=True, tag=self.tag),
        ]

        def own() -> None:
            del keep[:]  # gloo read the worker scale until phase one finished
            average_rows_(s.received.view(n, -1), s.scales, s.rows(n), shard.view(-1), s.index)

        keep = [scale]
        return _ChainedWork(first, own)
