"""DeepSpeed's memory-mapped indexed dataset format (``.bin`` + ``.idx``): reader, writer, layout."""

from __future__ import annotations

from .dataset import IndexedDataset, IndexedDatasetBuilder, write_flat, write_indexed_dataset
from .format import DTYPE_CODES, IndexedFormatError, dtype_code, fit_int_dtype

__all__ = [
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedFormatError",
    "dtype_code",
    "fit_int_dtype",
    "write_flat",
    "write_indexed_dataset",
]
