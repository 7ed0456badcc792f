"""DeepSpeed's (Megatron's) memory-mapped indexed dataset format, as pure functions: no files, no pickles.

A dataset is two files sharing a prefix. ``<prefix>.bin`` holds every item's elements back to back (one dtype, C
order, no header). ``<prefix>.idx`` is the index, little-endian::

    magic    9 bytes  b"MMIDIDX\\x00\\x00"
    version  uint64   1
    dtype    uint8    a code of DTYPE_CODES
    len      uint64   number of items
    docs     uint64   number of doc_idx entries
    sizes    int32[len]     elements per item
    pointers int64[len]     byte offset of each item in .bin (exclusive scan of sizes × itemsize)
    doc_idx  int64[docs]    item index where each document starts (DeepSpeed's writers: [0, ..., len])

The dtype codes are DeepSpeed 0.19.8's (``runtime/data_pipeline/data_sampling/indexed_dataset.py``): integers only
(Megatron's float codes are not in DeepSpeed's table), so metric values are integers in these files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint16),
    7: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
_HEADER = struct.Struct("<9sQBQQ")
HEADER_BYTES = _HEADER.size  # 34


class IndexedFormatError(ValueError):
    """A file that is not a valid indexed dataset (names the file and what is wrong)."""


def dtype_code(dtype: object) -> int:
    """DeepSpeed's code for ``dtype`` (a numpy dtype or type, or a torch integer dtype)."""
    wanted: np.dtype | None
    try:
        wanted = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:  # a torch dtype: torch.int64 -> "int64"
        try:
            wanted = np.dtype(str(dtype).removeprefix("torch."))
        except TypeError:
            wanted = None
    for code, candidate in DTYPE_CODES.items():
        if wanted == candidate:
            return code
    names = ", ".join(str(d) for d in DTYPE_CODES.values())
    raise IndexedFormatError(f"dtype {dtype} has no code in DeepSpeed's indexed format; use one of {names}")


def fit_int_dtype(min_value: int, max_value: int) -> np.dtype:
    """The smallest integer dtype holding [min_value, max_value]: DeepSpeed's ``find_fit_int_dtype``."""
    if min_value >= 0:
        for dtype in (np.uint8, np.uint16, np.uint32):
            if max_value <= np.iinfo(dtype).max:
                return np.dtype(dtype)
        return np.dtype(np.uint64)
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= min_value and max_value <= info.max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def pointers_of(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of each item: the exclusive prefix sum of ``sizes × itemsize`` (int64)."""
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(np.asarray(sizes[:-1], dtype=np.int64) * itemsize, out=pointers[1:])
    return pointers


def encode_index(dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> bytes:
    """The bytes of an ``.idx`` file for items of ``sizes`` elements of ``dtype``."""
    sizes = np.asarray(sizes)
    if len(sizes) and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
        raise IndexedFormatError("item sizes must lie in [0, 2**31): the index stores them as int32")
    header = _HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes), len(doc_idx))
    return b"".join(
        (
            header,
            sizes.astype("<i4").tobytes(),
            pointers_of(sizes, np.dtype(dtype).itemsize).astype("<i8").tobytes(),
            np.asarray(doc_idx, dtype="<i8").tobytes(),
        )
    )


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    num_items: int
    num_docs: int

    @property
    def total_bytes(self) -> int:
        """Size the whole ``.idx`` file must have."""
        return HEADER_BYTES + 4 * self.num_items + 8 * self.num_items + 8 * self.num_docs


def decode_header(raw: bytes, where: str | Path = "index") -> IndexHeader:
    """The header of an ``.idx`` file (its first ``HEADER_BYTES`` bytes); ``where`` names the file in errors."""
    if len(raw) < HEADER_BYTES:
        raise IndexedFormatError(f"{where}: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte index header")
    magic, version, code, num_items, num_docs = _HEADER.unpack(raw[:HEADER_BYTES])
    if magic != MAGIC:
        raise IndexedFormatError(f"{where}: not a memory-mapped indexed dataset index (magic {magic!r})")
    if version != VERSION:
        raise IndexedFormatError(f"{where}: index version {version}; only version {VERSION} exists")
    if code not in DTYPE_CODES:
        raise IndexedFormatError(f"{where}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    return IndexHeader(DTYPE_CODES[code], num_items, num_docs)


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")
