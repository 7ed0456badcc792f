"""Naming a ZeRO-3 parameter that was read while it was an empty placeholder.

Between uses a ZeRO-3 parameter's ``.data`` has no elements. Code that reads parameters outside their module's
forward under autograd — ``loss + λ·sum(p.pow(2).sum() for p in model.parameters())`` — computes on those
placeholders; the backward then hands each such parameter a 0-element gradient, which autograd rejects with
"Function PowBackward0 returned an invalid gradient at index 0 - got [0] but expected shape compatible with
[16, 8]" (or, where autograd lets it through, the unit's gradient hook does: grads.py). Neither names the
parameter nor says why. ``explain`` turns autograd's message into one that does: it walks the failed graph for
the function autograd named and lists the ZeRO-3 parameters that function feeds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from shardspeed.zero.stage3.grads import PlaceholderGradientError

# autograd's two ways of rejecting a 0-element gradient: a function's output checked against its input's shape
# (the parameter is used only outside forward), or two gradients of one parameter summed (used in both)
_INVALID_EMPTY = re.compile(r"Function (\w+) returned an invalid gradient at index \d+ - got \[0\]")
_SUM_WITH_EMPTY = re.compile(r"size of tensor a \(\d+\) must match the size of tensor b \(0\)|tensor a \(0\) must")


def explain(error: BaseException, loss: torch.Tensor, names: Mapping[int, str]) -> PlaceholderGradientError | None:
    """A clear error for ``error`` if it is autograd rejecting a placeholder's gradient, else None.
    ``names``: id of each ZeRO-3 parameter → its name."""
    invalid, summed = _INVALID_EMPTY.search(str(error)), _SUM_WITH_EMPTY.search(str(error))
    if (invalid is None and summed is None) or loss.grad_fn is None:
        return None
    parents = _parents_of_parameters(loss.grad_fn, names)
    if invalid is not None:  # the parameters the named function feeds
        culprits = [n for n, fns in parents.items() if invalid.group(1) in fns]
    else:  # parameters reached along more than one path: used in forward and again outside it
        culprits = [n for n, fns in parents.items() if len(fns) > 1]
    which = ", ".join(f"'{n}'" for n in culprits[:5]) if culprits else "a ZeRO-3 parameter"
    return PlaceholderGradientError(
        f"ZeRO-3 parameter(s) {which} were read outside their modules' forward (e.g. a penalty over "
        "model.parameters() after forward), where ZeRO-3 parameters are empty placeholders, so their gradients "
        "came back empty. Compute such terms inside the module's forward, or run them and the backward inside "
        "shardspeed.zero.GatheredParameters(params)."
    )


def _parents_of_parameters(root: torch.autograd.graph.Node, names: Mapping[int, str]) -> dict[str, list[str]]:
    """For each ZeRO-3 parameter in the graph: the names of the functions feeding its gradient (one per edge)."""
    found: dict[str, list[str]] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)  # AccumulateGrad: the leaf it accumulates into
            if variable is None:
                stack.append(nxt)
            elif id(variable) in names:
                found.setdefault(names[id(variable)], []).append(node.name())
    return found
