"""Write and read the tensors of a checkpoint: per-rank safetensors files of checksummed 1-D chunks.

``CheckpointWriter`` (one per rank) turns pieces of flattened tensors into chunks of at most ``chunk_bytes``,
each with its ``zlib.crc32``, packs them into ``rank{r:05d}-{i:03d}.safetensors`` files of at most ``file_bytes``
and fsyncs every file. It copies what it is given (the caller may reuse its buffers right after ``add``) but
writes a file as soon as the next chunk would not fit, so it never holds more than one file's worth of copies.

``CheckpointReader`` reads any range of any tensor, opening only the files whose chunks overlap the range, and
verifies the checksum of every chunk before using it (once per reader), so a rank that reads only its share of
a checkpoint still detects a damaged file — and names it. Reading never unpickles: data comes through
``safetensors.safe_open`` and the index/metadata are JSON.
"""

from __future__ import annotations

import bisect
import json
import math
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from shardspeed.checkpoint.box_io import read_sliced_range
from shardspeed.checkpoint.boxes import BoxRef, whole
from shardspeed.checkpoint.commit import fsync_directory, list_tags, resolve_tag
from shardspeed.checkpoint.index import (
    DTYPE_NAMES,
    INDEX_FILE,
    METADATA_FILE,
    CheckpointCorruptError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    TensorEntry,
    index_from_json,
    metadata_from_json,
)
from shardspeed.checkpoint.safetensors_file import SafetensorsStreamWriter, tensor_bytes
from shardspeed.config.errors import did_you_mean
from shardspeed.faults.inject import maybe_fail

__all__ = ["CheckpointReader", "CheckpointWriter", "chunk_crc32", "data_file_name", "list_tags", "resolve_tag"]

# Each open safetensors handle holds a memory mapping; consolidating a checkpoint of thousands of ranks must not
# keep thousands of them (vm.max_map_count), so the least recently used handles are dropped beyond this many.
MAX_OPEN_FILES = 64
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_NAMES_BY_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def data_file_name(rank: int, index: int) -> str:
    """The name of the ``index``-th data file written by ``rank``."""
    return f"rank{rank:05d}-{index:03d}.safetensors"


def chunk_crc32(chunk: torch.Tensor) -> int:
    """``zlib.crc32`` of a CPU tensor's raw bytes (any dtype, bf16 included)."""
    return zlib.crc32(tensor_bytes(chunk))


class CheckpointWriter:
    """One rank's writer into the shared temporary directory of a checkpoint being saved.

    Call ``add`` for every piece this rank owns, then ``finish`` once; gather all ranks' ``finish()`` lists
    (plain dicts) to the committing rank and pass their concatenation to ``commit_checkpoint``.
    """

    def __init__(self, tmp_dir: Path, rank: int, chunk_bytes: int = 64 << 20, file_bytes: int = 2 << 30) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        for label, value in (("chunk_bytes", chunk_bytes), ("file_bytes", file_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be a positive integer number of bytes, got {value!r}")
        self.tmp_dir = Path(tmp_dir)
        if not self.tmp_dir.is_dir():
            raise CheckpointNotFoundError(f"checkpoint temporary directory {self.tmp_dir} does not exist")
        self.rank, self.chunk_bytes, self.file_bytes = rank, chunk_bytes, file_bytes
        self._records: list[dict[str, Any]] = []
        self._pending: list[tuple[dict[str, Any], torch.Tensor]] = []  # (record, its CPU copy) not yet on disk
        self._pending_bytes = 0
        self._files_written = 0
        self._keys: set[tuple[str, tuple[int, ...], int]] = set()
        self._finished = False

    def add(
        self, name: str, full_shape: Sequence[int], start: int, data: torch.Tensor, box: BoxRef | None = None
    ) -> None:
        """Store ``data``, elements ``[start, start + data.numel())`` of the flattened tensor ``name`` — or, with
        ``box`` (a block of the tensor of shape ``full_shape``), of that box in its own row-major order.

        ``data`` is a 1-D tensor of any supported dtype on any device; it is copied before this returns.
        An empty ``data`` declares the tensor (shape and dtype) without contributing elements.
        """
        if self._finished:
            raise RuntimeError(f"CheckpointWriter of rank {self.rank}: add({name!r}) after finish()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        shape = tuple(int(size) for size in full_shape)
        if any(size < 0 for size in shape):
            raise ValueError(f"tensor {name!r}: full_shape {list(shape)} has a negative size")
        if not isinstance(data, torch.Tensor) or data.dim() != 1:
            got = f"shape {list(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(f"tensor {name!r}: data must be a 1-D tensor (flatten it with .reshape(-1)), got {got}")
        if data.dtype not in DTYPE_NAMES_BY_TORCH:
            raise ValueError(f"tensor {name!r}: dtype {data.dtype} is not storable; valid: {', '.join(DTYPE_NAMES)}")
        if box is not None and not box.inside(shape):
            raise ValueError(f"tensor {name!r}: box {box} does not fit in the full tensor of shape {list(shape)}")
        box = None if box is None or box == whole(shape) else box
        numel = math.prod(shape) if box is None else box.numel
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + data.numel() > numel:
            raise ValueError(
                f"tensor {name!r}: start={start!r} with {data.numel()} elements does not fit in the full tensor "
                f"of shape {list(shape)}{'' if box is None else f' (its box {box})'} ({numel} elements)"
            )
        elements_per_chunk = max(1, self.chunk_bytes // data.element_size())
        where = () if box is None else box.offset
        chunk_starts = [(name, where, start + offset) for offset in range(0, data.numel(), elements_per_chunk)]
        repeated = [element for key, _, element in chunk_starts if (key, where, element) in self._keys]
        if repeated:  # chunk keys must be unique within this rank's files
            raise ValueError(f"tensor {name!r}: this rank already added a piece covering element {repeated[0]}")
        self._keys.update(chunk_starts)
        base = {"name": name, "shape": list(shape), "dtype": DTYPE_NAMES_BY_TORCH[data.dtype], "rank": self.rank}
        if box is not None:
            base |= {"box_offset": list(box.offset), "box_shape": list(box.shape)}
        key_prefix = name if box is None else f"{name}@{'.'.join(map(str, box.offset))}"
        if data.numel() == 0:
            self._records.append({**base, "file": None, "key": None, "start": start, "end": start, "crc32": 0})
            return
        for offset in range(0, data.numel(), elements_per_chunk):
            piece = data[offset : offset + elements_per_chunk].detach()
            copy = piece.to("cpu", copy=True) if piece.device.type == "cpu" else piece.to("cpu")
            nbytes = copy.numel() * copy.element_size()
            if self._pending and self._pending_bytes + nbytes > self.file_bytes:
                self._write_pending()
            chunk_start = start + offset
            record = {
                **base,
                "file": data_file_name(self.rank, self._files_written),
                "key": f"{key_prefix}@{chunk_start}",
                "start": chunk_start,
                "end": chunk_start + copy.numel(),
                "crc32": chunk_crc32(copy),
            }
            self._pending.append((record, copy))
            self._pending_bytes += nbytes

    def _write_pending(self) -> None:
        # Larger elements first keeps every tensor's offset a multiple of its element size (aligned reads).
        ordered = sorted(self._pending, key=lambda pair: -pair[1].element_size())
        path = self.tmp_dir / data_file_name(self.rank, self._files_written)
        try:
            writer = SafetensorsStreamWriter(path, [(rec["key"], chunk.dtype, chunk.shape) for rec, chunk in ordered])
            try:
                for record, chunk in ordered:
                    maybe_fail("checkpoint_write", path)
                    writer.write(record["key"], chunk)
                writer.close(fsync=True)
            except BaseException:
                writer.abort()
                raise
        except OSError as error:
            if error.filename is not None:
                raise
            # a buffered write's ENOSPC (often raised at flush or close) names no file: name it
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
        self._records.extend(record for record, _ in self._pending)
        self._pending, self._pending_bytes = [], 0
        self._files_written += 1

    def finish(self) -> list[dict[str, Any]]:
        """Write what is pending, fsync the directory, and return this rank's chunk records (JSON-able dicts)."""
        if self._finished:
            raise RuntimeError(f"CheckpointWriter of rank {self.rank}: finish() called twice")
        if self._pending:
            self._write_pending()
        fsync_directory(self.tmp_dir)
        self._finished = True
        return list(self._records)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointCorruptError(f"checkpoint file {path} cannot be read: {error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointCorruptError(f"checkpoint file {path} is not valid JSON: {error}") from None


class CheckpointReader:
    """Random access to the tensors of one committed checkpoint directory (``save_dir/<tag>``)."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        if not self.ckpt_dir.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {self.ckpt_dir} does not exist")
        index_path = self.ckpt_dir / INDEX_FILE
        metadata_path = self.ckpt_dir / METADATA_FILE
        self._entries: dict[str, TensorEntry] = index_from_json(_read_json(index_path), str(index_path))
        self._metadata: dict[str, Any] = metadata_from_json(_read_json(metadata_path), str(metadata_path))
        # (name, box) → its chunks sorted by start, and their starts (for bisect)
        self._runs: dict[tuple[str, BoxRef], tuple[tuple[Any, ...], list[int]]] = {}
        self._handles: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._verified: set[tuple[str, str]] = set()
        self.files_opened = 0  # for tests and diagnostics: a rank should open only the files it needs
        self.chunks_read = 0

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata dict the saving caller passed to ``commit_checkpoint``."""
        return self._metadata

    def names(self, prefix: str = "") -> list[str]:
        """Tensor names (those starting with ``prefix``), in index order."""
        return [name for name in self._entries if name.startswith(prefix)]

    def has(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        """The index entry of ``name``; unknown names raise ``CheckpointKeyError`` (a KeyError) with a suggestion."""
        found = self._entries.get(name)
        if found is None:
            raise CheckpointKeyError(
                f"checkpoint {self.ckpt_dir} has no tensor {name!r}{did_you_mean(name, self._entries)}"
            )
        return found

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self.entry(name).dtype]

    def numel(self, name: str) -> int:
        return self.entry(name).numel

    def _open(self, file: str, name: str) -> Any:
        handle = self._handles.get(file)
        if handle is not None:
            self._handles.move_to_end(file)
        else:
            path = self.ckpt_dir / file
            if not path.is_file():
                raise CheckpointCorruptError(f"checkpoint data file {path} (holding tensor {name!r}) is missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error type for bad headers/truncation
                raise CheckpointCorruptError(
                    f"checkpoint data file {path} (holding tensor {name!r}) is truncated or corrupt: {error}"
                ) from None
            self._handles[file] = handle
            self.files_opened += 1
            if len(self._handles) > MAX_OPEN_FILES:
                self._handles.popitem(last=False)
        return handle

    def boxes(self, name: str) -> list[BoxRef]:
        """The boxes tensor ``name`` is stored as (one covering it for a tensor no rank stored sliced)."""
        return self.entry(name).boxes()

    def _load_chunk(self, entry: TensorEntry, chunk: Any, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` (relative to the chunk) of ``chunk``, checksum-verified."""
        handle = self._open(chunk.file, entry.name)
        path = self.ckpt_dir / chunk.file
        where = f"chunk {chunk.key!r} of tensor {entry.name!r} (elements [{chunk.start}, {chunk.end}))"
        self.chunks_read += 1
        try:
            if (chunk.file, chunk.key) in self._verified:
                return handle.get_slice(chunk.key)[start:end]
            data = handle.get_tensor(chunk.key)
        except Exception as error:
            raise CheckpointCorruptError(f"checkpoint data file {path}: cannot read {where}: {error}") from None
        if data.dtype != TORCH_DTYPES[entry.dtype] or data.shape != (chunk.end - chunk.start,):
            raise CheckpointCorruptError(
                f"checkpoint data file {path}: {where} holds {data.dtype} {list(data.shape)}, index.json says "
                f"{entry.dtype} [{chunk.end - chunk.start}]"
            )
        actual = chunk_crc32(data)
        if actual != chunk.crc32:
            raise CheckpointCorruptError(
                f"checkpoint data file {path} is corrupt: {where} has crc32 {actual:#010x}, index.json recorded "
                f"{chunk.crc32:#010x}"
            )
        self._verified.add((chunk.file, chunk.key))
        return data[start:end]

    def _check_range(self, name: str, start: int, end: int, box: BoxRef | None = None) -> TensorEntry:
        entry = self.entry(name)
        if not 0 <= start <= end <= (entry.numel if box is None else box.numel):
            raise ValueError(
                f"tensor {name!r}: range [{start}, {end}) is outside its {entry.numel} elements (shape "
                f"{list(entry.shape)})"
            )
        return entry

    def iter_range(
        self, name: str, start: int, end: int, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(offset, piece)``: consecutive verified pieces of elements ``[start, end)`` of ``name``.

        ``offset`` is relative to ``start``; each piece is at most one chunk, converted to ``dtype`` when given.
        Pieces may share memory with the file mapping: treat them as read-only and copy what you keep.
        The range is checked before the first piece is read (when this is called, not when iterated).
        """
        entry = self._check_range(name, start, end)
        boxes = entry.boxes()
        if len(boxes) == 1:  # stored whole (every DP-only checkpoint): straight from its chunks
            return self._pieces(entry, boxes[0], start, end, dtype)
        return read_sliced_range(self, name, start, end, dtype)  # assembled from the boxes overlapping the range

    def _pieces(
        self, entry: TensorEntry, box: BoxRef, start: int, end: int, dtype: torch.dtype | None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Consecutive pieces of elements ``[start, end)`` of one stored ``box`` of ``entry`` (its flat order)."""
        found = self._runs.get((entry.name, box))
        if found is None:
            run = entry.chunks_of(box)
            found = self._runs[(entry.name, box)] = (run, [chunk.start for chunk in run])
        run, starts = found
        position = max(0, bisect.bisect_right(starts, start) - 1)
        cursor = start
        while cursor < end:
            chunk = run[position]
            piece_end = min(end, chunk.end)
            piece = self._load_chunk(entry, chunk, cursor - chunk.start, piece_end - chunk.start)
            yield cursor - start, piece if dtype is None else piece.to(dtype)
            cursor, position = piece_end, position + 1

    def iter_box_range(
        self, name: str, box: BoxRef, start: int, end: int, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``iter_range`` within one stored box of ``name`` (one of ``boxes(name)``), in the box's flat order."""
        entry = self._check_range(name, start, end, box)
        if box not in entry.boxes():
            raise ValueError(f"tensor {name!r} is not stored as box {box}; its boxes: {entry.boxes()}")
        return self._pieces(entry, box, start, end, dtype)

    def verify_range(self, name: str, start: int, end: int, box: BoxRef | None = None) -> None:
        """Check every chunk overlapping elements ``[start, end)`` of ``name`` (of its stored ``box`` when given)
        (file present, readable, crc32), each once per reader, without counting them in ``chunks_read``: a load
        verifies all it will read before it changes anything, so a damaged file fails it with the engine's state
        untouched."""
        counted = self.chunks_read
        for _ in self.iter_range(name, start, end) if box is None else self.iter_box_range(name, box, start, end):
            pass
        self.chunks_read = counted

    def read_range_into(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Read elements ``[start, start + out.numel())`` of ``name`` into the 1-D tensor ``out`` (any dtype/device).

        Conversion to ``out``'s dtype happens piece by piece, so no full-size temporary is made.
        """
        if out.dim() != 1:
            raise ValueError(f"tensor {name!r}: out must be 1-D, got shape {list(out.shape)}")
        for offset, piece in self.iter_range(name, start, start + out.numel()):
            out[offset : offset + piece.numel()].copy_(piece)
        return out

    def read_range(self, name: str, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name`` as a new 1-D CPU tensor."""
        self._check_range(name, start, end)
        out = torch.empty(end - start, dtype=dtype or self.dtype(name))
        return self.read_range_into(name, start, out)

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` in its full shape, as a new CPU tensor."""
        return self.read_range(name, 0, self.numel(name), dtype).reshape(self.shape(name))

    def close(self) -> None:
        """Drop the open file handles (memory mappings)."""
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
