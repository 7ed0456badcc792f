"""The first batch checked identical across the tensor axis.

Ranks of one tensor-parallel group compute one model replica together, so they must see the same batch: a script
that slices its data by global rank instead of by ``topology.dp_rank`` feeds them different samples, and the
f/g all-reduces then silently sum activations of unrelated inputs (training "works", the loss is nonsense). On the
engine's first forward only — nothing after it, no per-step cost — each rank fingerprints the tensor arguments
(argument path, shape, dtype, crc32 of the bytes), the fingerprints are all-gathered over the tensor axis, and
every tensor rank raises the same error naming the ranks and the argument if they differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.faults.errors import mark_agreed
from shardspeed.topology import AxisGroup

__all__ = ["BatchMismatchError", "FirstBatchCheck", "batch_fingerprint", "first_batch_difference"]

Entry = tuple[str, tuple[int, ...], str, int]
"""(argument path, shape, dtype, crc32 of the bytes)"""


class BatchMismatchError(ValueError):
    """Ranks of one tensor-parallel group were given different first batches."""


def _checksum(tensor: torch.Tensor) -> int:
    """crc32 of the tensor's bytes: exact (any differing element changes it with overwhelming probability) and
    cheap enough for one batch. Done once, so a device tensor's copy to the host costs one sync, once."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return zlib.crc32(raw.cpu().numpy().tobytes())


def batch_fingerprint(args: tuple, kwargs: Mapping[str, Any]) -> list[Entry]:
    """Pure: one entry per tensor found in ``args`` / ``kwargs`` (nested lists, tuples and dicts walked), named by
    its path (``args[0]``, ``kwargs['labels']``, ``args[1]['mask']``), in a fixed order."""
    out: list[Entry] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            out.append((path, tuple(value.shape), str(value.dtype), _checksum(value)))
        elif isinstance(value, Mapping):
            for key in sorted(value, key=repr):
                walk(value[key], f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    for i, arg in enumerate(args):
        walk(arg, f"args[{i}]")
    for key in sorted(kwargs):
        walk(kwargs[key], f"kwargs[{key!r}]")
    return out


def first_batch_difference(everyone: list[list[Entry]], ranks: tuple[int, ...]) -> str | None:
    """Pure: None when every rank's fingerprint equals the first one's; else a sentence naming the two global
    ranks and the first argument that differs (and how)."""
    base = everyone[0]
    for index, other in enumerate(everyone):
        if other == base:
            continue
        a, b = ranks[0], ranks[index]
        by_path = {entry[0]: entry for entry in other}
        for entry in base:
            theirs = by_path.get(entry[0])
            if theirs is None:
                return f"argument {entry[0]} is a tensor on rank {a} but not on rank {b}"
            if theirs != entry:
                what = (
                    "its values differ (checksums)"
                    if theirs[1:3] == entry[1:3]
                    else f"shape/dtype {entry[1]} {entry[2]} on rank {a} vs {theirs[1]} {theirs[2]} on rank {b}"
                )
                return f"argument {entry[0]} differs between ranks {a} and {b}: {what}"
        extra = sorted(set(by_path) - {entry[0] for entry in base})
        return f"argument {extra[0]} is a tensor on rank {b} but not on rank {a}"
    return None


class FirstBatchCheck:
    """Called on every engine forward; does its work once (the first forward), then only returns. Nothing to do
    when the tensor axis has one rank."""

    def __init__(self, axis: AxisGroup, collectives: Collectives) -> None:
        self.axis = axis
        self.collectives = collectives
        self.pending = axis.size > 1

    def __call__(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        if not self.pending:
            return
        self.pending = False  # checked once, whatever the outcome
        everyone = self.collectives.all_gather_object(batch_fingerprint(args, kwargs), self.axis)
        difference = first_batch_difference(everyone, self.axis.ranks)  # type: ignore[arg-type]
        if difference is not None:  # computed from the same gathered list: the same error on every tensor rank
            raise mark_agreed(
                BatchMismatchError(
                    f"the first batch differs across the tensor-parallel group (global ranks "
                    f"{list(self.axis.ranks)}): {difference}. Every rank of a tensor-parallel group must get the "
                    "same batch: split data by the data axis (topology.dp_rank / dp_world_size), not by global rank"
                )
            )
