"""Helpers of zero.Init's materialization (``materialize.py``): the module walk order, the NaN check that detects
unwritten tensors, and which ``init_fn`` a module's tensors were created with."""

from __future__ import annotations

import torch

from shardspeed.zero.stage3.init import InitFn, creation_record

__all__ = ["has_nan", "init_fn_of", "post_order"]


def post_order(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules children-first (each once, at its first position), with their paths."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module, path: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name)
        out.append((path, m))

    visit(root, "")
    return out


def has_nan(tensor: torch.Tensor) -> bool:
    """Whether any element is NaN, without a tensor-sized temporary in the common case: a NaN makes the sum NaN
    (the exact check only runs then, so +inf and -inf summing to NaN is no false alarm)."""
    return bool(torch.isnan(tensor.sum())) and bool(torch.isnan(tensor).any())


def init_fn_of(module: torch.nn.Module) -> InitFn | None:
    """The init_fn of the zero.Init context that created this module's tensors (the first one that has one)."""
    for tensor in [*module._parameters.values(), *module._buffers.values()]:
        record = creation_record(tensor) if tensor is not None else None
        if record is not None and record.settings.init_fn is not None:
            return record.settings.init_fn
    return None
