"""The checkpoint's JSON schema: chunk records, the tensor index (``index.json``) and ``metadata.json``. Pure.

A checkpoint stores every tensor under a rank-agnostic *name* (``param/gpt.wte.weight``,
``optim/gpt.wte.weight/exp_avg``) as its full shape, dtype, and a list of *chunks*: ``[start, end)`` is a range of
the flattened full tensor, ``file``/``key`` locate the 1-D data of that range inside a safetensors file and
``crc32`` is ``zlib.crc32`` of its raw bytes. Which rank wrote a chunk does not matter to a reader, which is what
lets a checkpoint saved at one world size and ZeRO stage load into any other.

Under tensor parallelism a tensor is stored as *boxes* of its global shape (``box_offset``/``box_shape`` on a chunk;
absent: the box is the whole tensor, as in every format-version-1 checkpoint), and a chunk's ``[start, end)`` is a
flat range of its box ([Note: flat ranges of boxes restrict to flat ranges] in boxes.py). The boxes of a tensor
must tile it exactly once, and each box's chunks must tile the box.

Chunks of all ranks together must tile each tensor exactly once; ``build_index`` checks that at commit and
``index_from_json`` checks it again at load (so a hand-edited or damaged index fails by name, not with wrong
weights). A record whose ``file`` is None *declares* a tensor without data (a rank whose share is empty), so a
tensor that somebody declared but nobody wrote is a reported gap rather than a silently missing entry.

Nothing here touches files or torch: dtypes are safetensors-compatible names such as ``"bfloat16"``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardspeed.checkpoint.boxes import BoxRef, intersect

FORMAT_VERSION = 2  # 2: chunks may be flat ranges of boxes (tensor parallelism); version 1 still loads
INDEX_FILE = "index.json"
METADATA_FILE = "metadata.json"

# The dtype names the store maps to torch dtypes; the same spelling as torch's attribute names.
DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
_RECORD_FIELDS = ("name", "shape", "dtype", "file", "key", "start", "end", "crc32")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read; the message names the file, tag or tensor at fault."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory, tag, ``latest`` file or data file does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is damaged (bad JSON, truncated data, checksum mismatch); the message names the file."""


class CheckpointKeyError(CheckpointError, KeyError):
    """A tensor name the checkpoint does not hold (a KeyError whose message is not shown in quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointTilingError(CheckpointError, ValueError):
    """The chunks of a tensor leave a gap, overlap, or disagree on its shape/dtype."""


@dataclass(frozen=True)
class ChunkRef:
    """Where elements ``[start, end)`` of a tensor's flattened data live, and their checksum."""

    file: str
    key: str
    start: int
    end: int
    crc32: int
    box: BoxRef | None = None  # the box of the tensor that [start, end) is a flat range of; None: the whole tensor


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint: full shape, dtype name and its chunks sorted by ``start``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[ChunkRef, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def boxes(self) -> list[BoxRef]:
        """The boxes the tensor is stored as, in order (the whole tensor when its chunks name none)."""
        seen: dict[BoxRef, None] = {}
        for chunk in self.chunks:
            seen.setdefault(chunk.box or BoxRef((0,) * len(self.shape), self.shape))
        return list(seen) or [BoxRef((0,) * len(self.shape), self.shape)]

    def chunks_of(self, box: BoxRef) -> tuple[ChunkRef, ...]:
        """The chunks tiling ``box``, sorted by start."""
        wanted = None if box == BoxRef((0,) * len(self.shape), self.shape) else box
        return tuple(c for c in self.chunks if c.box == wanted)


def _require_int(value: Any, what: str, minimum: int = 0) -> int:
    # bool is an int subclass; True as a shape would be a bug upstream, so reject it explicitly.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _require_str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise CheckpointError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _parse_shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(f"{what} must be a list of integers, got {value!r}")
    return tuple(_require_int(size, f"{what}[{position}]") for position, size in enumerate(value))


def _parse_dtype(value: Any, what: str) -> str:
    if value not in DTYPE_NAMES:
        raise CheckpointError(f"{what} is {value!r}; valid dtypes: {', '.join(DTYPE_NAMES)}")
    return value


def _parse_box(raw: Mapping[str, Any], shape: tuple[int, ...], what: str) -> BoxRef | None:
    """The optional ``box_offset``/``box_shape`` of a chunk or record; None for the whole tensor."""
    if raw.get("box_offset") is None and raw.get("box_shape") is None:
        return None
    offset = _parse_shape(raw.get("box_offset"), f"{what}.box_offset")
    size = _parse_shape(raw.get("box_shape"), f"{what}.box_shape")
    box = BoxRef(offset, size) if len(offset) == len(size) else None
    if box is None or not box.inside(shape):
        raise CheckpointError(
            f"{what}: box at {list(offset)} of shape {list(size)} does not fit in the tensor's shape {list(shape)}"
        )
    return None if box == BoxRef((0,) * len(shape), shape) else box


def _parse_chunk(raw: Any, what: str, shape: tuple[int, ...] = ()) -> ChunkRef:
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{what} must be an object with file, key, start, end, crc32; got {raw!r}")
    missing = [field for field in ("file", "key", "start", "end", "crc32") if field not in raw]
    if missing:
        raise CheckpointError(f"{what} lacks {', '.join(missing)}")
    return ChunkRef(
        file=_require_str(raw["file"], f"{what}.file"),
        key=_require_str(raw["key"], f"{what}.key"),
        start=_require_int(raw["start"], f"{what}.start"),
        end=_require_int(raw["end"], f"{what}.end"),
        crc32=_require_int(raw["crc32"], f"{what}.crc32"),
        box=_parse_box(raw, shape, what),
    )


def _describe(chunk: ChunkRef) -> str:
    return f"[{chunk.start}, {chunk.end}) in {chunk.file}"


def check_tiling(entry: TensorEntry) -> None:
    """Raise ``CheckpointTilingError`` unless the boxes tile the tensor exactly once and each box's chunks cover
    its ``[0, numel)`` exactly once (chunks are sorted by box, then start)."""
    boxes = entry.boxes()
    where = f"tensor {entry.name!r} (shape {list(entry.shape)}, {entry.numel} elements)"
    for i, box in enumerate(boxes):
        for other in boxes[:i]:
            if intersect(box, other) is not None:
                raise CheckpointTilingError(f"{where}: boxes at {list(other.offset)} and {list(box.offset)} overlap")
    if sum(box.numel for box in boxes) != entry.numel:  # disjoint boxes inside the tensor: equal counts tile it
        raise CheckpointTilingError(
            f"{where}: its boxes ({', '.join(f'{list(b.shape)} at {list(b.offset)}' for b in boxes)}) leave elements "
            "written by no rank"
        )
    for box in boxes:
        inside = "" if len(boxes) == 1 else f" box at {list(box.offset)} of shape {list(box.shape)}"
        _check_box_tiling(entry.chunks_of(box), box.numel, where + inside)


def _check_box_tiling(chunks: tuple[ChunkRef, ...], numel: int, where: str) -> None:
    covered = 0
    for chunk in chunks:
        if chunk.end <= chunk.start:
            raise CheckpointTilingError(f"{where}: chunk {_describe(chunk)} is empty or reversed")
        if chunk.end > numel:
            raise CheckpointTilingError(f"{where}: chunk {_describe(chunk)} ends beyond the tensor")
        if chunk.start > covered:
            raise CheckpointTilingError(f"{where}: elements [{covered}, {chunk.start}) are written by no rank")
        if chunk.start < covered:
            raise CheckpointTilingError(
                f"{where}: chunk {_describe(chunk)} overlaps elements written by another chunk (up to {covered})"
            )
        covered = chunk.end
    if covered != numel:
        raise CheckpointTilingError(f"{where}: elements [{covered}, {numel}) are written by no rank")


def _sorted_entry(name: str, shape: tuple[int, ...], dtype: str, chunks: list[ChunkRef]) -> TensorEntry:
    zeros = (0,) * len(shape)
    ordered = sorted(chunks, key=lambda c: (c.box.offset if c.box else zeros, c.start))
    entry = TensorEntry(name=name, shape=shape, dtype=dtype, chunks=tuple(ordered))
    check_tiling(entry)
    return entry


def build_index(records: Iterable[Mapping[str, Any]]) -> dict[str, TensorEntry]:
    """Group all ranks' chunk records by tensor and validate them (shape/dtype agreement, exact tiling).

    Records are what ``CheckpointWriter.finish`` returns. Tensors keep the order of their first record, so when
    ranks add tensors in model order and rank 0's records come first, the index lists the model in order.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    chunks: dict[str, list[ChunkRef]] = {}
    for position, record in enumerate(records):
        what = f"chunk record #{position}"
        if not isinstance(record, Mapping):
            raise CheckpointError(f"{what} must be a dict as returned by CheckpointWriter.finish(), got {record!r}")
        missing = [field for field in _RECORD_FIELDS if field not in record]
        if missing:
            raise CheckpointError(f"{what} lacks {', '.join(missing)} (got keys {sorted(record)})")
        name = _require_str(record["name"], f"{what}.name")
        what = f"{what} of tensor {name!r}"
        shape = _parse_shape(record["shape"], f"{what}.shape")
        dtype = _parse_dtype(record["dtype"], f"{what}.dtype")
        if name not in shapes:
            shapes[name], dtypes[name], chunks[name] = shape, dtype, []
        elif shapes[name] != shape:
            raise CheckpointTilingError(
                f"tensor {name!r} is written with shape {list(shapes[name])} and with shape {list(shape)}"
            )
        elif dtypes[name] != dtype:
            raise CheckpointTilingError(f"tensor {name!r} is written with dtype {dtypes[name]} and with {dtype}")
        if record["file"] is not None:  # None: a declaration without data
            chunks[name].append(_parse_chunk(record, what, shape))
    return {name: _sorted_entry(name, shapes[name], dtypes[name], chunks[name]) for name in shapes}


def index_to_json(entries: Mapping[str, TensorEntry]) -> dict[str, Any]:
    """The JSON object stored as ``index.json``."""
    return {
        "format_version": FORMAT_VERSION,
        "tensors": {
            name: {
                "shape": list(entry.shape),
                "dtype": entry.dtype,
                "chunks": [_chunk_to_json(c) for c in entry.chunks],
            }
            for name, entry in entries.items()
        },
    }


def _chunk_to_json(chunk: ChunkRef) -> dict[str, Any]:
    out: dict[str, Any] = {"file": chunk.file, "key": chunk.key, "start": chunk.start, "end": chunk.end}
    out["crc32"] = chunk.crc32
    if chunk.box is not None:
        out["box_offset"], out["box_shape"] = list(chunk.box.offset), list(chunk.box.shape)
    return out


def _check_version(document: Any, source: str) -> None:
    if not isinstance(document, Mapping):
        raise CheckpointCorruptError(f"{source}: expected a JSON object, got {type(document).__name__}")
    version = document.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointCorruptError(f"{source}: 'format_version' must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: format version {version} was written by a newer shardspeed; this one reads up to "
            f"version {FORMAT_VERSION}"
        )


def index_from_json(document: Any, source: str) -> dict[str, TensorEntry]:
    """Parse and validate an ``index.json`` object; errors name ``source`` (the file) and the key path."""
    _check_version(document, source)
    tensors = document.get("tensors")
    if not isinstance(tensors, Mapping):
        raise CheckpointCorruptError(f"{source}: 'tensors' must be an object mapping names to entries")
    entries: dict[str, TensorEntry] = {}
    try:
        for name, raw in tensors.items():
            what = f"tensors[{name!r}]"
            if not isinstance(raw, Mapping):
                raise CheckpointError(f"{what} must be an object with shape, dtype, chunks")
            raw_chunks = raw.get("chunks")
            if not isinstance(raw_chunks, list):
                raise CheckpointError(f"{what}.chunks must be a list, got {raw_chunks!r}")
            shape = _parse_shape(raw.get("shape"), f"{what}.shape")
            entries[name] = _sorted_entry(
                name,
                shape,
                _parse_dtype(raw.get("dtype"), f"{what}.dtype"),
                [_parse_chunk(chunk, f"{what}.chunks[{i}]", shape) for i, chunk in enumerate(raw_chunks)],
            )
    except CheckpointError as error:
        raise CheckpointCorruptError(f"{source}: {error}") from None
    return entries


def find_non_json(value: Any, path: str = "metadata") -> str | None:
    """The key path of the first value that JSON cannot store faithfully (e.g. a tensor or a set), or None.

    Dict keys must be strings: ``json.dumps`` would silently turn an int key into a string, so a resumed run
    would see ``{"1": ...}`` where it saved ``{1: ...}``.
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            found = find_non_json(item, f"{path}[{position}]")
            if found:
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} key {key!r} ({type(key).__name__}; keys must be strings)"
            found = find_non_json(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    return f"{path} ({type(value).__name__})"


def metadata_to_json(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object stored as ``metadata.json``: the caller's plain-data dict plus the format version."""
    culprit = find_non_json(dict(metadata))
    if culprit:
        raise CheckpointError(
            f"checkpoint metadata must be plain JSON data (dict with str keys, list, str, int, float, bool, None); "
            f"{culprit} is not — store tensors as checkpoint tensors and bytes as base64 strings"
        )
    return {"format_version": FORMAT_VERSION, "metadata": dict(metadata)}


def metadata_from_json(document: Any, source: str) -> dict[str, Any]:
    """The caller's metadata dict from a parsed ``metadata.json``."""
    _check_version(document, source)
    metadata = document.get("metadata")
    if not isinstance(metadata, dict):
        raise CheckpointCorruptError(f"{source}: 'metadata' must be an object, got {type(metadata).__name__}")
    return metadata


def dumps(document: Mapping[str, Any]) -> str:
    """Serialise a checkpoint JSON document deterministically (sorted keys would reorder the tensor index)."""
    return json.dumps(document, indent=1) + "\n"
