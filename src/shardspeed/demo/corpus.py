"""The demo's training text: the Python standard library's own source, read as bytes. Nothing to download.

Files are visited in sorted path order and the total is capped, so every rank (and every run on the same
Python) builds the identical token stream without talking to the others. The stream is cut into fixed-length
windows; the tail of the stream is held out for the evaluation loss, so evaluation text is never trained on.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Directories under the stdlib root that are not the standard library itself (installed packages), are
# mostly test data, or are generated tables; skipping them keeps the text typical Python.
_SKIPPED_DIRECTORIES = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
)
FILE_SEPARATOR = b"\n\n"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_source_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside the skipped directories, sorted by relative path."""
    found: list[Path] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_DIRECTORIES]
        found.extend(Path(directory, name) for name in files if name.endswith(".py"))
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def read_corpus(max_bytes: int, root: Path | None = None) -> bytes:
    """The first ``max_bytes`` bytes of the concatenated source files (separated by a blank line)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = root if root is not None else stdlib_root()
    chunks: list[bytes] = []
    total = 0
    for path in python_source_files(root):
        try:
            content = path.read_bytes()
        except OSError:  # unreadable file: deterministic everywhere it happens, so skipping is safe
            continue
        chunks.append(content + FILE_SEPARATOR)
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise RuntimeError(f"found no Python source files under {root} to train on")
    return corpus


def byte_tokens(data: bytes) -> torch.Tensor:
    """Bytes as a 1-D uint8 tensor: byte value = token id (vocabulary of 256). uint8 keeps it 8× smaller."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``window`` tokens; item i is (input, target), target shifted by one.

    Window i reads tokens ``[i·window, (i+1)·window]`` (window + 1 tokens, the last one only as a target),
    so the windows tile the stream and every token is predicted exactly once.
    """

    def __init__(self, tokens: torch.Tensor, window: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.tokens = tokens
        self.window = window

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.window)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.window
        chunk = self.tokens[start : start + self.window + 1].long()
        return chunk[:-1], chunk[1:]


def train_eval_split(tokens: torch.Tensor, window: int, eval_fraction: float = 0.05) -> tuple[ByteWindows, ByteWindows]:
    """Training windows from the head of the stream, evaluation windows from its tail (no overlap)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    split = int(len(tokens) * (1.0 - eval_fraction))
    return ByteWindows(tokens[:split], window), ByteWindows(tokens[split:], window)
