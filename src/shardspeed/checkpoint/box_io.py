"""Reading and writing boxes of global tensors through the chunk store: a rank's local parameter range ↔ the
checkpoint's boxes ([Note: flat ranges of boxes restrict to flat ranges] in boxes.py).

A rank's ``Piece`` is a flat range of its *local* parameter; under tensor parallelism that parameter holds one or
more boxes of the global tensor (``ParamSpec.boxes``: one, or ``parts`` for a fused tensor). Saving writes the
range's part of each box as a flat range of that box; loading fills each part from every stored box that intersects
it, whatever mesh wrote them. Reads are bounded: at most ``BLOCK`` elements of an overlap at a time, each reading the
stored span it touches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from shardspeed.checkpoint.boxes import BoxRef, local_runs, overlaps, whole

if TYPE_CHECKING:
    from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter
    from shardspeed.params.spec import ParamSpec

BLOCK = 1 << 20  # elements of one overlap handled at a time (index tensors and stored spans stay bounded)

LocalBoxes = list[tuple[BoxRef, BoxRef]]
"""(the box in the local parameter's coordinates, the same box in the global tensor's coordinates)."""


def local_boxes(spec: ParamSpec, tp_rank: int, tp_size: int) -> LocalBoxes:
    """The boxes a rank's parameter holds, from its spec (one covering everything when it is not split)."""
    return [(BoxRef(b.local_offset, b.shape), BoxRef(b.global_offset, b.shape)) for b in spec.boxes(tp_rank, tp_size)]


def _read_stored(reader: CheckpointReader, name: str, box: BoxRef, start: int, out: torch.Tensor) -> None:
    for offset, piece in reader.iter_box_range(name, box, start, start + out.numel()):
        out[offset : offset + piece.numel()].copy_(piece)


def read_box_into(reader: CheckpointReader, name: str, box: BoxRef, start: int, out: torch.Tensor) -> None:
    """Fill the 1-D ``out`` with elements ``[start, start + out.numel())`` of ``box`` (global coordinates) of the
    stored tensor ``name``, from every stored box that overlaps it (they tile the tensor: all of it is filled)."""
    end = start + out.numel()
    for stored in reader.boxes(name):
        for t in overlaps(stored, 0, stored.numel, box, start, end, BLOCK):
            if t.src_index is None or t.dst_index is None:
                _read_stored(reader, name, stored, t.src_start, out[t.dst_start : t.dst_start + t.count])
                continue
            span = torch.empty(t.src_span, dtype=reader.dtype(name))
            _read_stored(reader, name, stored, t.src_start, span)
            values = span[t.src_index - t.src_start].to(device=out.device, dtype=out.dtype)
            out[t.dst_index.to(out.device)] = values


def verify_box_range(reader: CheckpointReader, name: str, box: BoxRef, start: int, end: int) -> None:
    """Verify (``CheckpointReader.verify_range``) every stored chunk ``read_box_into`` would read for this range."""
    for stored in reader.boxes(name):
        for t in overlaps(stored, 0, stored.numel, box, start, end, BLOCK):
            reader.verify_range(name, t.src_start, t.src_start + t.src_span, box=stored)


def read_sliced_range(
    reader: CheckpointReader, name: str, start: int, end: int, dtype: torch.dtype | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """``CheckpointReader.iter_range`` of a tensor stored as several boxes: the global flat range assembled block by
    block (so ``zero-to-fp32`` streams TP-sliced tensors like whole ones)."""
    target = whole(reader.shape(name))
    for first in range(start, end, BLOCK):
        out = torch.empty(min(BLOCK, end - first), dtype=dtype or reader.dtype(name))
        read_box_into(reader, name, target, first, out)
        yield first - start, out


def read_local_into(
    reader: CheckpointReader, name: str, boxes: LocalBoxes, local_shape: Sequence[int], start: int, out: torch.Tensor
) -> None:
    """Fill ``out`` (1-D: elements ``[start, start + out.numel())`` of the local parameter of ``local_shape``, which
    holds ``boxes``) from the stored tensor ``name``."""
    for local, glob in boxes:
        a, _, t = local_runs(local_shape, start, start + out.numel(), local)
        if t is None:
            continue
        if t.dst_index is None:
            read_box_into(reader, name, glob, a, out[t.dst_start : t.dst_start + t.count])
        else:
            values = torch.empty(t.count, dtype=out.dtype, device=out.device)
            read_box_into(reader, name, glob, a, values)
            out[t.dst_index.to(out.device)] = values


def verify_local(
    reader: CheckpointReader, name: str, boxes: LocalBoxes, local_shape: Sequence[int], start: int, end: int
) -> None:
    """Verify every stored chunk ``read_local_into`` would read for local elements ``[start, end)``."""
    for local, glob in boxes:
        a, b, t = local_runs(local_shape, start, end, local)
        if t is not None:
            verify_box_range(reader, name, glob, a, b)


def write_local(
    writer: CheckpointWriter,
    name: str,
    global_shape: Sequence[int],
    boxes: LocalBoxes,
    local_shape: Sequence[int],
    start: int,
    data: torch.Tensor,
) -> None:
    """Store ``data`` (local elements ``[start, start + data.numel())``) as flat ranges of the global boxes it
    meets; a range meeting none only declares the tensor (shape and dtype)."""
    wrote = False
    for local, glob in boxes:
        a, _, t = local_runs(local_shape, start, start + data.numel(), local)
        if t is None:
            continue
        part = data[t.dst_start : t.dst_start + t.count] if t.dst_index is None else data[t.dst_index.to(data.device)]
        writer.add(name, global_shape, a, part.detach().contiguous(), box=glob)
        wrote = True
    if not wrote:
        writer.add(name, global_shape, 0, data[:0].detach().contiguous())
