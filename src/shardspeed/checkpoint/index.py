"""The checkpoint's JSON schema: chunk records, the tensor index (``index.json``) and ``metadata.json``. Pure.

A checkpoint stores every tensor under a rank-agnostic *name* (``param/gpt.wte.weight``,
``optim/gpt.wte.weight/exp_avg``) as its full shape, dtype, and a list of *chunks*: ``[start, end)`` is a range of
the flattened full tensor, ``file``/``key`` locate the 1-D data of that range inside a safetensors file and
``crc32`` is ``zlib.crc32`` of its raw bytes. Which rank wrote a chunk does not matter to a reader, which is what
lets a checkpoint saved at one world size and ZeRO stage load into any other.

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

FORMAT_VERSION = 1
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


def _parse_chunk(raw: Any, what: str) -> ChunkRef:
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
    )


def _describe(chunk: ChunkRef) -> str:
    return f"[{chunk.start}, {chunk.end}) in {chunk.file}"


def check_tiling(entry: TensorEntry) -> None:
    """Raise ``CheckpointTilingError`` unless the chunks cover ``[0, numel)`` exactly once (they are sorted)."""
    numel = entry.numel
    where = f"tensor {entry.name!r} (shape {list(entry.shape)}, {numel} elements)"
    covered = 0
    for chunk in entry.chunks:
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
    entry = TensorEntry(name=name, shape=shape, dtype=dtype, chunks=tuple(sorted(chunks, key=lambda c: c.start)))
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
            chunks[name].append(_parse_chunk(record, what))
    return {name: _sorted_entry(name, shapes[name], dtypes[name], chunks[name]) for name in shapes}


def index_to_json(entries: Mapping[str, TensorEntry]) -> dict[str, Any]:
    """The JSON object stored as ``index.json``."""
    return {
        "format_version": FORMAT_VERSION,
        "tensors": {
            name: {
                "shape": list(entry.shape),
                "dtype": entry.dtype,
                "chunks": [
                    {"file": c.file, "key": c.key, "start": c.start, "end": c.end, "crc32": c.crc32}
                    for c in entry.chunks
                ],
            }
            for name, entry in entries.items()
        },
    }


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
            entries[name] = _sorted_entry(
                name,
                _parse_shape(raw.get("shape"), f"{what}.shape"),
                _parse_dtype(raw.get("dtype"), f"{what}.dtype"),
                [_parse_chunk(chunk, f"{what}.chunks[{i}]") for i, chunk in enumerate(raw_chunks)],
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
