"""Reading and writing DeepSpeed's memory-mapped indexed datasets (``format.py`` has the layout).

``IndexedDataset(prefix)`` maps ``<prefix>.bin`` and ``<prefix>.idx`` read-only with ``np.memmap``; item ``i`` is a
read-only numpy view, so a 1M-item index costs no copy. ``IndexedDatasetBuilder(prefix, dtype)`` appends items to
``<prefix>.bin`` and writes the index at ``finalize()``, as DeepSpeed's ``MMapIndexedDatasetBuilder`` does (same
``doc_idx`` convention: starts at ``[0]``, ``end_document()`` appends the item count). Both directions are tested
against DeepSpeed's own classes (tests/unit/test_indexed_dataset.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .format import HEADER_BYTES, IndexedFormatError, data_path, decode_header, dtype_code, encode_index, index_path


class IndexedDataset(torch.utils.data.Dataset):
    """A memory-mapped indexed dataset; ``ds[i]`` is item ``i`` as a read-only numpy array."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        idx_file, bin_file = index_path(prefix), data_path(prefix)
        for f in (idx_file, bin_file):
            if not f.is_file():
                raise FileNotFoundError(f"indexed dataset {self.prefix!r}: {f} does not exist")
        with open(idx_file, "rb") as stream:
            header = decode_header(stream.read(64), idx_file)
        if idx_file.stat().st_size != header.total_bytes:
            raise IndexedFormatError(
                f"{idx_file}: {idx_file.stat().st_size} bytes, but its header ({header.num_items} items, "
                f"{header.num_docs} doc_idx entries) needs {header.total_bytes}: the file is truncated or corrupt"
            )
        self.dtype = header.dtype
        index = np.memmap(idx_file, mode="r", dtype=np.uint8)
        offset = HEADER_BYTES
        n = header.num_items
        self.sizes = np.frombuffer(index, dtype="<i4", count=n, offset=offset)
        self.pointers = np.frombuffer(index, dtype="<i8", count=n, offset=offset + 4 * n)
        self.doc_idx = np.frombuffer(index, dtype="<i8", count=header.num_docs, offset=offset + 12 * n)
        needed = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        bin_bytes = bin_file.stat().st_size
        if bin_bytes < needed:
            raise IndexedFormatError(f"{bin_file}: {bin_bytes} bytes, but its index needs {needed}: truncated")
        # np.memmap cannot map an empty file; an empty dataset has nothing to read anyway.
        self._data = np.memmap(bin_file, mode="r", dtype=self.dtype) if bin_bytes else np.empty(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"indexed dataset items are read by integer index, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for an indexed dataset of {n} items")
        i = int(i) % n
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self._data[start : start + int(self.sizes[i])]

    @property
    def flat(self) -> np.ndarray:
        """Every element of every item, in order (items are contiguous in ``.bin``)."""
        return self._data[: int(self.sizes.sum(dtype=np.int64))]


class IndexedDatasetBuilder:
    """Writes ``<prefix>.bin`` item by item, then ``<prefix>.idx`` at :meth:`finalize`."""

    def __init__(self, prefix: str | Path, dtype: Any = np.int64) -> None:
        dtype_code(dtype)  # an unsupported dtype fails before any file is created
        self.prefix = str(prefix)
        self.dtype = np.dtype(str(dtype).removeprefix("torch.")) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(data_path(prefix), "wb")  # noqa: SIM115 - closed by finalize()
        self._sizes: list[np.ndarray] = []
        self._doc_idx = [0]
        self._count = 0

    def add_item(self, item: Any) -> None:
        """Append one item (a tensor, array or sequence of numbers; flattened)."""
        array = item.numpy() if isinstance(item, torch.Tensor) else np.asarray(item)
        self.add_items(array.reshape(-1), np.array([array.size]))

    def add_items(self, flat: np.ndarray, sizes: np.ndarray) -> None:
        """Append ``len(sizes)`` items at once: ``flat`` holds their elements back to back."""
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != flat.size:
            raise ValueError(f"add_items: sizes sum to {int(sizes.sum())} but flat has {flat.size} elements")
        values = np.asarray(flat)
        cast = values.astype(self.dtype)
        if values.size and not np.array_equal(cast, values):
            raise ValueError(f"add_items: values do not fit {self.dtype} (range {values.min()}..{values.max()})")
        self._file.write(cast.astype(self.dtype.newbyteorder("<")).tobytes())
        self._sizes.append(sizes)
        self._count += len(sizes)

    def end_document(self) -> None:
        self._doc_idx.append(self._count)

    def finalize(self) -> None:
        """Close ``.bin`` and write ``.idx`` (last, so a complete index means a complete dataset)."""
        self._file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int64)
        index_path(self.prefix).write_bytes(encode_index(self.dtype, sizes, np.array(self._doc_idx)))


def write_indexed_dataset(prefix: str | Path, items: Iterable[Any], dtype: Any = np.int64) -> None:
    """Write ``items`` as one document, as DeepSpeed's ``create/close_mmap_dataset_builder`` pair does."""
    builder = IndexedDatasetBuilder(prefix, dtype)
    for item in items:
        builder.add_item(item)
    builder.end_document()
    builder.finalize()


def write_flat(prefix: str | Path, flat: np.ndarray, sizes: np.ndarray, dtype: Any) -> None:
    """Write items given as one flat array plus their sizes (vectorised), as one document."""
    builder = IndexedDatasetBuilder(prefix, dtype)
    builder.add_items(flat, sizes)
    builder.end_document()
    builder.finalize()
