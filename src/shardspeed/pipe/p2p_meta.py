"""What a pipeline message looks like on the wire, as pure functions: the meta header and the partitioned slices.

[Note: pipeline message framing] A message between two stages is a tuple of tensors. Before the first message of a
``(peer, stream)`` (before every message with ``dynamic_shape``) the sender sends one header: ``HEADER_SLOTS`` int64
values ``[MAGIC, crc32(stream), count, (dtype code, requires_grad, ndim, *shape) per tensor, 0…]``. The header has a
fixed size so the receiver can post its receive before knowing anything, allocates the tensors from it, then
receives the data: one flat tensor per element of the tuple (a partitioned float tensor: this tensor rank's slice,
see ``partition_slice``), zero-element tensors not sent at all. Both sides derive the wire layout from the same
metas, so after negotiation only data crosses the link.

The magic number and the stream's checksum let the receiver tell a framing error (a data message read where a
header was expected, or a header of another stream) from a valid header: both mean the two sides disagree on the
order of messages on the link, which would otherwise read one message's bytes as another's.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DTYPE_CODES",
    "HEADER_SLOTS",
    "MAGIC",
    "TensorMeta",
    "decode_header",
    "describe",
    "encode_header",
    "is_partitioned",
    "partition_slice",
    "stream_checksum",
]

HEADER_SLOTS = 64  # int64 values: 512 bytes, sent once per stream (every message with dynamic_shape)
MAGIC = 0x53535031  # "SSP1"

# Codes are part of the wire format: append, never reorder.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
DTYPE_CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a message as the receiver must rebuild it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def __str__(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{grad}"


def stream_checksum(stream: str) -> int:
    return zlib.crc32(stream.encode())


def describe(tensors: Sequence[object], where: str) -> tuple[TensorMeta, ...]:
    """The metas of a message, refusing what cannot cross a link: ``where`` names the call in the error.

    ``requires_grad`` is kept only for floating-point (and complex) tensors, the only ones autograd can flow
    through; the receiver sets it on its fresh tensor so the stage's backward reaches it."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (tuple, list)):
        raise TypeError(f"{where}: expected a tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{where}: an empty tuple has nothing to send")
    metas = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{where}: element {i} of the tuple is {type(tensor).__name__}, not a tensor; only tensors cross a "
                "pipeline stage boundary (drop None entries, or send a placeholder tensor)"
            )
        if tensor.dtype not in DTYPE_CODES:
            raise TypeError(f"{where}: element {i} has dtype {tensor.dtype}, which pipeline messages do not carry")
        grad = bool(tensor.requires_grad) and (tensor.is_floating_point() or tensor.is_complex())
        metas.append(TensorMeta(tensor.dtype, tuple(tensor.shape), grad))
    return tuple(metas)


def encode_header(metas: Sequence[TensorMeta], stream: str) -> list[int]:
    """The header's ``HEADER_SLOTS`` values (zero-padded)."""
    values = [MAGIC, stream_checksum(stream), len(metas)]
    for meta in metas:
        values += [DTYPE_CODES[meta.dtype], int(meta.requires_grad), len(meta.shape), *meta.shape]
    if len(values) > HEADER_SLOTS:
        raise ValueError(
            f"pipeline message on stream {stream!r} needs a {len(values)}-value header (tensors: "
            f"{', '.join(map(str, metas))}); headers hold {HEADER_SLOTS}: send fewer or lower-dimensional tensors"
        )
    return values + [0] * (HEADER_SLOTS - len(values))


def decode_header(values: Sequence[int], stream: str, peer: int) -> tuple[TensorMeta, ...]:
    """The metas a header describes; a value that is not a header of ``stream`` is a framing error naming both."""
    if len(values) != HEADER_SLOTS or values[0] != MAGIC:
        raise RuntimeError(
            f"pipeline p2p framing error: expected the meta header of stream {stream!r} from rank {peer}, received "
            "something else: the two stages disagree on the order of messages on this link (every stage must "
            "receive in the order its peer sends, and call reset_shapes() at the same point)"
        )
    if values[1] != stream_checksum(stream):
        raise RuntimeError(
            f"pipeline p2p framing error: expected the meta header of stream {stream!r} from rank {peer}, received "
            "a header of another stream: the two stages disagree on the order of messages on this link"
        )
    count, pos, metas = values[2], 3, []
    for _ in range(count):
        code, grad, ndim = values[pos : pos + 3]
        if not 0 <= code < len(_DTYPES):
            raise RuntimeError(f"pipeline p2p header from rank {peer} on {stream!r}: unknown dtype code {code}")
        shape = tuple(int(s) for s in values[pos + 3 : pos + 3 + ndim])
        metas.append(TensorMeta(_DTYPES[code], shape, bool(grad)))
        pos += 3 + ndim
    return tuple(metas)


def is_partitioned(meta: TensorMeta, parts: int) -> bool:
    """Whether ``meta``'s tensor travels as 1/``parts`` slices (``pipe_partitioned``): floating-point tensors of
    at least ``parts`` elements; integer and bool tensors (masks, positions) and tiny ones go whole."""
    return parts > 1 and meta.dtype.is_floating_point and meta.numel >= parts


def partition_slice(numel: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of slice ``index`` of a flat tensor of ``numel`` elements padded to a multiple of
    ``parts``: every slice has the same length (all-gather needs equal shards); the last is padded."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"partition_slice: index {index} outside {parts} parts")
    length = -(-numel // parts)
    return index * length, length
