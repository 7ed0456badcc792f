"""Argument checks ``Collectives`` runs before any collective or comms-log record, so a bad call raises a clear
``ValueError`` instead of a raw torch error after a call was logged (and a simulated-link hold started).

[Note: symmetric argument checks] These checks look at this rank's arguments only. They are symmetric across
ranks (every rank raises, none is left blocked in a collective) when every rank's sizes derive from the same
shapes — true of every shardspeed caller: the compressed collectives (compression/collective.py) size both
buffers from ``numel`` and the axis size, identical on every rank. A caller whose sizes differ between ranks
should run with ``verify_order`` (its exchange compares shapes) — or, without it, the peers wait in the collective
until the failure board or the timeout ends them.
"""

from __future__ import annotations

import torch

from shardspeed.topology import AxisGroup


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch in its storage, [start, end) (an over-estimate for strided views)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (same storage, overlapping byte ranges)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def check_all_to_all(output: torch.Tensor, tensor: torch.Tensor, axis: AxisGroup) -> None:
    """``all_to_all_single``'s arguments: equal sizes divisible by the axis size, a contiguous ``output`` that
    does not alias ``tensor`` (an all-to-all is not in-place safe). [Note: symmetric argument checks]"""
    if output.numel() != tensor.numel() or tensor.numel() % axis.size:
        raise ValueError(
            f"all_to_all_single: {tensor.numel()} elements in, {output.numel()} out: equal "
            f"sizes divisible by the {axis.name} axis' {axis.size} ranks are required"
        )
    if output.dtype != tensor.dtype:
        raise ValueError(f"all_to_all_single: output is {output.dtype}, input {tensor.dtype}: they must match")
    if not output.is_contiguous():
        raise ValueError(f"all_to_all_single: output {tuple(output.shape)} must be contiguous (it is received into)")
    if overlaps(output, tensor):
        raise ValueError("all_to_all_single: output aliases the input; an all-to-all is not in-place safe")
