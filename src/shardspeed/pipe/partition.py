"""Which layers each pipeline stage holds: pure functions of the layer list, identical on every rank.

``parts`` is DeepSpeed's boundary list: part ``i`` holds global layers ``parts[i] <= idx < parts[i + 1]``; there
are ``num_stages · virtual_stages`` parts. With interleaving (``virtual_stages`` = v > 1) part ``c·p + s`` is
model chunk ``c`` of pipe rank ``s`` (Megatron's interleaving, ``instructions.py``'s virtual stages), so rank ``s``
holds parts ``s, s + p, s + 2p, …``.

Methods (DeepSpeed's ``partition_method``):
- ``"parameters"``: balance the trainable parameter counts (each layer built once on the meta device to count);
- ``"uniform"``: balance the layer counts;
- ``"type:REGEX"``: balance the number of layers whose class name matches REGEX (case-insensitive search).

[Note: balanced partition] Balancing minimizes the *bottleneck*, the heaviest part's weight, as DeepSpeed does over
prefix sums: a binary search over integer bottlenecks, each probed greedily (each part takes layers while its sum
stays under the bottleneck). Unlike DeepSpeed, no part may be empty (a stage with no layers would only forward
its input): the greedy probe stops a part early when the layers left are just enough for one per remaining part,
which keeps the bottleneck (any single layer fits under it) and leaves every part at least one layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from shardspeed.pipe.spec import layer_class_name, trainable_numel

__all__ = [
    "chunk_bounds",
    "layer_weights",
    "owner_of",
    "partition_balanced",
    "partition_layers",
    "partition_uniform",
]


def _check_counts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"cannot partition into {num_parts} parts")
    if num_items < num_parts:
        raise ValueError(
            f"{num_items} layers cannot fill {num_parts} pipeline parts (stages × virtual stages): every part needs "
            f"at least one layer"
        )


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving each part ``num_items // num_parts`` items, the first ``num_items % num_parts`` one more."""
    _check_counts(num_items, num_parts)
    size, extra = divmod(num_items, num_parts)
    return [i * size + min(i, extra) for i in range(num_parts + 1)]


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Boundaries minimizing the heaviest part's total weight, every part non-empty ([Note: balanced partition])."""
    _check_counts(len(weights), num_parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be non-negative, got {list(weights)}")
    prefix = [0, *accumulate(int(w) for w in weights)]
    lo, hi = max(max(weights), -(-prefix[-1] // num_parts)), prefix[-1]
    while lo < hi:  # the smallest bottleneck the greedy probe can meet
        mid = (lo + hi) // 2
        if _probe(prefix, num_parts, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    parts = _probe(prefix, num_parts, lo)
    assert parts is not None
    return parts


def _probe(prefix: list[int], num_parts: int, bottleneck: int) -> list[int] | None:
    """Greedy boundaries with every part's sum <= ``bottleneck`` and non-empty, or None when they do not fit."""
    n = len(prefix) - 1
    parts = [0]
    for p in range(num_parts):
        start = parts[-1]
        last = n - (num_parts - p - 1)  # leave one layer for each part after this one
        end = start + 1
        while end < last and prefix[end + 1] - prefix[start] <= bottleneck:
            end += 1
        if prefix[end] - prefix[start] > bottleneck:
            return None
        parts.append(end)
    return parts if parts[-1] == n else None


def layer_weights(layers: Sequence[Any], method: str) -> list[int] | None:
    """Per-layer weights for ``method`` (None for ``"uniform"``: layer counts). Raises ValueError for an unknown
    method or a type regex matching no layer."""
    key = method.lower()
    if key == "uniform":
        return None
    if key == "parameters":
        return [trainable_numel(layer) for layer in layers]
    if key.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"partition_method '{method}': invalid regex ({exc})") from None
        weights = [1 if regex.search(layer_class_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer_class_name(layer) for layer in layers})
            raise ValueError(f"partition_method '{method}' matches no layer (layer classes: {names})")
        return weights
    raise ValueError(f"partition_method '{method}' is unknown: expected 'parameters', 'uniform' or 'type:REGEX'")


def partition_layers(layers: Sequence[Any], method: str, num_stages: int, virtual_stages: int = 1) -> list[int]:
    """``parts`` (length ``num_stages · virtual_stages + 1``) for ``layers`` by ``method``."""
    num_parts = num_stages * virtual_stages
    _check_counts(len(layers), num_parts)
    weights = layer_weights(layers, method)
    if weights is None:
        return partition_uniform(len(layers), num_parts)
    return partition_balanced(weights, num_parts)


def chunk_bounds(parts: Sequence[int], num_stages: int, stage_id: int, chunk: int) -> tuple[int, int]:
    """Global layer range ``[start, stop)`` of local chunk ``chunk`` on pipe rank ``stage_id``."""
    part = chunk * num_stages + stage_id
    return parts[part], parts[part + 1]


def owner_of(layer_idx: int, parts: Sequence[int], num_stages: int) -> tuple[int, int]:
    """(pipe rank, local chunk) holding global layer ``layer_idx``."""
    if not 0 <= layer_idx < parts[-1]:
        raise ValueError(f"layer {layer_idx} outside the {parts[-1]} layers")
    part = next(i for i in range(len(parts) - 1) if parts[i] <= layer_idx < parts[i + 1])
    return part % num_stages, part // num_stages
