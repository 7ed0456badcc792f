"""Write safetensors files in a stream: the header first (from shapes alone), then each tensor's bytes in turn.

``safetensors.torch.save_file`` needs every tensor in memory at once (and versions before 0.6 serialise them to
one ``bytes`` object, i.e. twice). The format makes streaming easy because the header only needs shapes and
dtypes: an 8-byte little-endian header length, a JSON header mapping each key to ``dtype``, ``shape`` and
``data_offsets`` (relative to the data start), then the data, back to back with no holes. We pad the header with
spaces (allowed by the format) so the data starts 8-byte aligned, and require keys ordered so that every tensor's
offset is a multiple of its element size (largest elements first does it), so zero-copy readers get aligned data.
Files written here load with ``safetensors.safe_open`` / ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch

# torch dtype → safetensors dtype code.
SAFETENSORS_DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous (bf16 included, via a uint8 view)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensors are declared up front and then written in declaration order.

    ``entries`` is ``[(key, dtype, shape), ...]``. ``write(key, data)`` may be called several times per key
    with consecutive pieces (any shapes) until the key's bytes are complete, so a caller can stream a tensor
    that it never holds whole. ``close()`` checks every byte was written, optionally fsyncs, and closes.
    """

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
        require_alignment: bool = True,
    ) -> None:
        """``require_alignment``: every tensor starts at a multiple of its element size (what zero-copy readers
        like); safetensors itself does not require it, so a writer with a fixed key order may turn it off."""
        self.path = Path(path)
        self._expected: list[tuple[str, torch.dtype, int]] = []
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(key): str(value) for key, value in metadata.items()}
        offset = 0
        for key, dtype, shape in entries:
            if key in header:
                raise ValueError(f"{self.path}: key {key!r} is declared twice")
            if dtype not in SAFETENSORS_DTYPE_CODES:
                raise ValueError(f"{self.path}: key {key!r} has dtype {dtype}, which safetensors cannot store")
            itemsize = torch.empty((), dtype=dtype).element_size()
            if require_alignment and offset % itemsize:
                raise ValueError(
                    f"{self.path}: key {key!r} ({dtype}) would start at byte {offset}, not a multiple of its "
                    f"element size {itemsize}; declare keys with larger elements first"
                )
            nbytes = itemsize * _numel(shape)
            header[key] = {
                "dtype": SAFETENSORS_DTYPE_CODES[dtype],
                "shape": [int(size) for size in shape],
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((key, dtype, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        self._handle = open(self.path, "wb")  # noqa: SIM115 — closed in close(), possibly across many writes
        self._handle.write(struct.pack("<Q", len(encoded)))
        self._handle.write(encoded)
        self._position = 0  # index into _expected of the key being written
        self._written = 0  # bytes of that key written so far

    def write(self, key: str, data: torch.Tensor) -> None:
        """Append ``data`` (a CPU tensor of the declared dtype) to ``key``, which must be the key being written."""
        while (  # skip zero-size keys: they have no bytes, so nobody needs to write them
            self._written == 0
            and self._position < len(self._expected)
            and self._expected[self._position][2] == 0
            and self._expected[self._position][0] != key
        ):
            self._position += 1
        if self._position >= len(self._expected) or self._expected[self._position][0] != key:
            current = self._expected[self._position][0] if self._position < len(self._expected) else None
            raise ValueError(f"{self.path}: write to {key!r} out of order; expected {current!r}")
        _, dtype, nbytes = self._expected[self._position]
        if data.dtype != dtype:
            raise ValueError(f"{self.path}: key {key!r} was declared {dtype}, got data of dtype {data.dtype}")
        payload = tensor_bytes(data)
        if self._written + len(payload) > nbytes:
            raise ValueError(f"{self.path}: key {key!r} gets more than its declared {nbytes} bytes")
        self._handle.write(payload)
        self._written += len(payload)
        if self._written == nbytes:
            self._position, self._written = self._position + 1, 0

    def close(self, fsync: bool = False) -> None:
        """Finish the file: every declared byte must have been written. ``fsync`` makes it durable."""
        try:
            incomplete = [key for key, _, nbytes in self._expected[self._position :] if nbytes]
            if incomplete:
                raise ValueError(f"{self.path}: closed before the data of {incomplete[0]!r} was complete")
            self._handle.flush()
            if fsync:
                os.fsync(self._handle.fileno())
        finally:
            self._handle.close()

    def abort(self) -> None:
        """Close and delete a file that will not be completed."""
        try:
            self._handle.close()  # flushes what is buffered, which fails again on a full disk
        except OSError:
            pass  # the caller is already raising the error that made it abort
        finally:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
