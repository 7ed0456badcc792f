"""DeepSpeed's per-tensor compressed all-reduce for several tensors at once: every tensor keeps its own padding,
error buffers and scales, but the two collectives of one call carry all of them.

[Note: partwise compressed all-reduce] DeepSpeed's OnebitAdam compresses each parameter's momentum with its own
``compressed_allreduce`` ([Note: per-parameter compression] in onebit_adam.py): four collectives per parameter,
so a model of many small tensors is bound by the collectives' latency (measured on the demo GPT, 28 tensors, gloo
on 2 CPU cores: 112 waits per step, ~2/3 of the step spent in them). ``PartwiseCompressedAllReduce`` does the same
math per part — tensor j padded to ``padded_numel(n_j, N)``, its worker scale, error and chunks, its server's
average, scale and error exactly as ``CompressedAllReduce`` over that tensor alone, so the results and error
buffers are the same bits — with the wire data of every part laid side by side, rank-major, and the fp32 scales
as the row's last bytes:

    row r  = [part 0's chunk r signs | part 1's chunk r signs | ... | P scales (4 bytes each)]
             (row_bytes = Σ chunk_j / 8 sign bytes, then 4 P scale bytes)

1. worker: per part, the input is added into its worker error, compressed (``compress_compensated_``) and its N
   chunks' bytes copied into column range j of the N send rows; the P worker scales go into every row (each
   server needs all of them); one ``all_to_all_single`` of the rows.
2. server: per part, rank r's received row holds everyone's chunk r of it and everyone's scales:
   ``average_rows_`` with that part's N scales, add into its server error, recompress into column range j of one
   row, its P server scales at the end; one ``all_gather`` of the row.
3. per part, the N gathered chunks are unpacked straight into the caller's tensor.
Traffic is the sum of the per-part calls' (the same padded bytes; the scales cost what DeepSpeed's scale
all-gathers do, (N − 1) · 4P bytes per rank each way), in 2 collectives instead of 4P: each collective is a point
where the ranks wait for the slowest, and on a CPU host those waits, not the bytes, cost. Phase 2 runs in
``wait()`` ([Note: compressed work]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardspeed.comm.collectives import Collectives
from shardspeed.comm.work import Work
from shardspeed.compression.collective import Workspace, _ChainedWork, _ErrorFed, unpack_range_
from shardspeed.compression.signs import BLOCK, average_rows_, compress_compensated_, padded_numel
from shardspeed.topology import AxisGroup


class PartwiseCompressedAllReduce(_ErrorFed):
    """The mean over ``axis`` of each of several fp32 tensors of the given ``sizes``, error-fed 1-bit, each exactly
    as its own ``CompressedAllReduce`` would compute it, in two collectives per call ([Note: partwise compressed
    all-reduce]). Exact (no compression, no communication) on an axis of size 1. The error buffers are flat: part
    j's worker error is ``worker_error[W_j : W_j + padded_j]``, its server error ``server_error[S_j : S_j +
    chunk_j]`` (prefix sums in part order); ``meta`` records the sizes, so another split of the same total does not
    load."""

    def __init__(
        self,
        sizes: list[int],
        axis: AxisGroup,
        collectives: Collectives,
        *,
        device: torch.device,
        tag: str = "compressed",
        workspace: Workspace | None = None,
    ) -> None:
        if not sizes or any(size < 1 for size in sizes):
            raise ValueError(f"PartwiseCompressedAllReduce: sizes must be positive, got {sizes}")
        n = axis.size
        self.sizes, self.numel = list(sizes), sum(sizes)
        self.axis, self.collectives, self.device, self.tag = axis, collectives, device, tag
        self.workspace = workspace or Workspace(device)
        self.padded = [padded_numel(size, n) if n > 1 else size for size in sizes]
        self.chunks = [padded // n for padded in self.padded]
        self._worker_at = _prefix(self.padded)  # element offsets into worker_error
        self._server_at = _prefix(self.chunks)  # element offsets into server_error
        self._byte_at = [at // 8 for at in self._server_at]  # byte offsets into a row
        self.row_bytes = sum(self.chunks) // 8
        self.worker_error = torch.zeros(sum(self.padded) if n > 1 else 0, device=device)
        self.server_error = torch.zeros(sum(self.chunks) if n > 1 else 0, device=device)
        self._errors = {"worker_error": self.worker_error, "server_error": self.server_error}
        self._wire: dict[str, Tensor] | None = None

    _meta_fields = "[numel, axis size, *part sizes]"

    def _meta(self) -> Tensor:
        return torch.tensor([self.numel, self.axis.size, *self.sizes], dtype=torch.int64)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of this instance's wire buffers (allocated at the first call); work buffers: ``workspace``."""
        return 0 if self._wire is None else sum(t.numel() * t.element_size() for t in self._wire.values())

    def launch(self, parts: list[Tensor]) -> Work:
        """Start the all-reduce of ``parts`` (floating tensors of ``sizes``, in order; each receives its mean in
        place once the Work is waited). One call in flight per instance. ``done()`` stays False until ``wait()``
        ([Note: compressed work]): wait it, in the same program order on every rank."""
        if [p.numel() for p in parts] != self.sizes or any(not p.is_floating_point() for p in parts):
            raise ValueError(
                f"PartwiseCompressedAllReduce: parts of {[p.numel() for p in parts]} elements, expected floating "
                f"tensors of {self.sizes}"
            )
        n, c = self.axis.size, self.collectives
        if n == 1:
            return Work(None)
        if self._wire is None:
            dev, width = self.device, self.row_bytes + 4 * len(self.sizes)
            self._wire = {
                "send": torch.empty(n, width, dtype=torch.uint8, device=dev),
                "received": torch.empty(n, width, dtype=torch.uint8, device=dev),
                "own": torch.empty(width, dtype=torch.uint8, device=dev),
                "scales": torch.empty(len(self.sizes), device=dev),
                "all_scales": torch.empty(n, len(self.sizes), device=dev),
            }
        w, ws, rb = self._wire, self.workspace, self.row_bytes
        for j, part in enumerate(parts):
            padded, chunk, at = self.padded[j], self.chunks[j], self._worker_at[j]
            error = self.worker_error[at : at + padded]
            error[: part.numel()].add_(part.reshape(-1))  # padding: zeros + error = error
            packed = ws.get("packed", padded // 8, torch.uint8)
            bits, floats = ws.get("bits", min(padded, BLOCK), torch.bool), ws.get("floats", min(padded, BLOCK))
            w["scales"][j : j + 1].copy_(compress_compensated_(error, packed, bits, floats))
            b = self._byte_at[j]
            w["send"][:, b : b + chunk // 8].copy_(packed.view(n, chunk // 8))
        w["send"][:, rb:].copy_(w["scales"].view(torch.uint8).expand(n, -1))  # every server needs every scale
        sent = c.all_to_all_single(w["received"].view(-1), w["send"].view(-1), self.axis, async_op=True, tag=self.tag)
        return _ChainedWork([sent], lambda: self._serve(parts))

    def _serve(self, parts: list[Tensor]) -> None:
        """Steps 2-3: per part, average this rank's chunk and recompress it with its server error; gather every
        rank's; unpack each part in place."""
        n, c, w, ws = self.axis.size, self.collectives, self._wire, self.workspace
        assert w is not None
        rb = self.row_bytes
        _scales_of(w["received"], rb, w["all_scales"])
        rows = ws.get("floats", n * BLOCK).view(n, BLOCK)
        for j in range(len(parts)):
            chunk, b, at = self.chunks[j], self._byte_at[j], self._server_at[j]
            error = self.server_error[at : at + chunk]
            received = w["received"][:, b : b + chunk // 8]
            index = ws.get("index", chunk // 8, torch.int32)
            average_rows_(received, w["all_scales"][:, j], rows, ws.get("mean", chunk), index, add_to=error)
            bits, floats = ws.get("bits", min(chunk, BLOCK), torch.bool), ws.get("floats", min(chunk, BLOCK))
            scale = compress_compensated_(error, w["own"][b : b + chunk // 8], bits, floats)
            w["scales"][j : j + 1].copy_(scale)
        w["own"][rb:].copy_(w["scales"].view(torch.uint8))
        c.all_gather(w["received"].view(-1), w["own"], self.axis, async_op=True, tag=self.tag).wait()
        _scales_of(w["received"], rb, w["all_scales"])  # now the servers' scales
        for j, part in enumerate(parts):
            chunk, b = self.chunks[j], self._byte_at[j]
            direct = part.dtype == torch.float32 and part.is_contiguous()
            dest = part.view(-1) if direct else torch.empty(part.numel(), device=self.device)
            index = ws.get("index", chunk // 8, torch.int32)
            unpack_range_(dest, 0, chunk, w["received"][:, b : b + chunk // 8], w["all_scales"][:, j], index)
            if not direct:
                part.copy_(dest.view_as(part))


def _scales_of(rows: Tensor, row_bytes: int, out: Tensor) -> None:
    """``out`` (N, P) fp32 <- the scale bytes that follow the ``row_bytes`` sign bytes of each of the N rows."""
    out.view(torch.uint8).view(rows.shape[0], -1).copy_(rows[:, row_bytes:])


def _prefix(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return out
