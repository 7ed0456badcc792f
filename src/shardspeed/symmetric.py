"""Symmetric checks: compare a small fingerprint across ranks before the collectives that depend on it.

gloo and NCCL match collectives by call order and size only, so ranks that disagree about the model (a different
layer count, a different dtype) would otherwise hang or silently mix unrelated tensors. One all_gather_object of
a fingerprint turns that into the same clear error on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.faults.errors import mark_agreed
from shardspeed.topology import AxisGroup


def model_fingerprint(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, shape, dtype, requires_grad) for every parameter and buffer, in registration order."""
    entries = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    entries += [(n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return entries


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            if x != y:
                return f"{x!r} vs {y!r}"
        return f"{len(a)} entries vs {len(b)} entries"
    return f"{a!r} vs {b!r}"


_AXIS_WORDS = {
    "data": "data-parallel ranks",
    "tensor": "tensor-parallel ranks",
    "pipe": "pipeline ranks",
    "model": "model-parallel ranks",
    "world": "ranks",
}


def check_same_on_all_ranks(value: Any, axis: AxisGroup, collectives: Collectives, what: str) -> None:
    """Raise the same ValueError on every rank of ``axis`` unless all ranks passed an equal ``value``. The error
    names the two global ranks (``axis`` is usually ``topology.world``: every rank must take the same branch)."""
    raise_if_different(collectives.all_gather_object(value, axis), axis, what)


def raise_if_different(everyone: list[Any], axis: AxisGroup, what: str) -> None:
    """The comparison of ``check_same_on_all_ranks`` on an already gathered list (one value per rank of ``axis``)."""
    for index, other in enumerate(everyone):
        if other != everyone[0]:
            words = _AXIS_WORDS.get(axis.name, f"{axis.name} ranks")
            raise mark_agreed(  # every rank compares the same gathered list: the same error everywhere
                ValueError(
                    f"{what} differs between {words} {axis.ranks[0]} and {axis.ranks[index]}: "
                    f"{_first_difference(everyone[0], other)}"
                )
            )
