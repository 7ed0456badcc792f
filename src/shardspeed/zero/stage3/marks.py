"""How the runtime sees one forward call of a ZeRO-3 module begin and end its backward: ``BackwardUse``.

[Note: backward uses] A forward call of a unit's module (with grad enabled) creates one ``BackwardUse``:
``_UseStart`` wraps the module's outputs, and a gradient hook watches its inputs that require grad. Backward
reaches the output side first, so ``_UseStart``'s backward says "this call's backward begins: gather the units";
the inputs' gradients are complete only after every node inside the module that contributes to them has run, so
the input hook says "this call's backward work is done". Counting started-but-not-ended uses per unit tells the
runtime when a unit is needed in backward — for frozen units too, which get no gradient to watch. The input hook
is ``register_multi_grad_hook(mode="all")``: it waits only for the inputs this backward reaches, and (a tensor
hook, not a node wrapped around the inputs) leaves in-place changes of an input inside the module exactly as
autograd would see them without ZeRO-3.
A use counts only once its start fired: marks created by a recomputation whose graph autograd throws away
(non-reentrant checkpointing) never start and hold nothing; marks created by a reentrant recomputation are part
of the graph its inner backward runs, and work like the ones of an ordinary forward.

``_UseStart`` returns ``t.detach()`` rather than a view: an output that is a view created inside a custom
Function may not be modified in place (``x = self.embed(t); x += self.pos``, ``torch.relu_(self.fc(x))``), a
detached alias may (DeepSpeed does the same). The alias shares the tensor's version counter, so an in-place change
of an output the module saved for backward (tanh, relu) is still caught by autograd. Outputs that share memory
with each other (a tensor and a view of it, both returned) keep ``view_as``: modifying a detached alias of one
would change the other behind autograd's back, so there torch's error is the right answer. A lone output that is
a view of a module-internal tensor (``nn.Linear`` on 3-D input returns one) is detached: nothing else sees its
base, so the in-place change stays exact. (``ctx.mark_dirty`` would return the tensors themselves, but it bumps
their version, which breaks every module whose last op saves its output.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class BackwardUse:
    """One forward call of a module that needs ``units`` in its backward. ``marked``: its inputs are watched, so
    the end of its backward is observed; otherwise the units' gradients tell (runtime.py)."""

    __slots__ = ("ended", "handle", "marked", "node", "started", "started_in", "units")

    def __init__(self, units: tuple[int, ...]) -> None:
        self.units = units
        self.marked = False
        self.started = False
        self.started_in = -1  # which backward (runtime's count) started it: a retained graph is run again
        self.ended = False
        self.handle: RemovableHandle | None = None  # the input hook, removed once it fired or the backward ended
        # the output mark's autograd node (weakly: a use must not keep a discarded graph and its activations alive)
        self.node: weakref.ref[Any] | None = None

    @property
    def pending(self) -> bool:
        """Its backward may still come: the graph holding its output mark is alive and the use has not started."""
        return not self.started and self.node is not None and self.node() is not None


def _aliases(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Detached aliases, except for tensors sharing memory with another one of ``tensors`` (see module docstring)."""
    storages = [t.untyped_storage().data_ptr() if t.layout is torch.strided else None for t in tensors]
    shared = {s for s in storages if s is not None and storages.count(s) > 1}
    return tuple(t.view_as(t) if s in shared else t.detach() for t, s in zip(tensors, storages))


class _UseStart(torch.autograd.Function):
    """Identity on the module's outputs; its backward runs before the module's backward (gathers the units)."""

    @staticmethod
    def forward(ctx: Any, on_start: Callable[[BackwardUse], None], use: BackwardUse, *tensors: torch.Tensor) -> Any:
        ctx.on_start, ctx.use = on_start, use
        ctx.set_materialize_grads(False)
        return _aliases(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.on_start(ctx.use)
        return (None, None, *grads)


def watch_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], use: BackwardUse, on_end: Callable[[BackwardUse], None]
) -> RemovableHandle | None:
    """Call ``on_end(use)`` once the gradients of the call's top-level positional and keyword tensors that require
    grad are computed (those this backward reaches). Tensors nested in containers are not watched: a call with
    none then ends by its unit's gradients instead (later, never wrongly). None: nothing to watch."""
    tensors = [a for a in args if _needs_grad(a)] + [v for v in kwargs.values() if _needs_grad(v)]
    if not tensors:
        return None
    use.marked = True
    return torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: on_end(use), mode="all")


def mark_outputs(output: Any, use: BackwardUse, on_start: Callable[[BackwardUse], None]) -> tuple[Any, bool]:
    """Route the module's differentiable outputs (a tensor, or tuples/lists/dicts of them) through one
    ``_UseStart``; whether any was (if none, nothing in backward needs this call)."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            wrapped = _UseStart.apply(on_start, use, output)[0]
            use.node = weakref.ref(wrapped.grad_fn)
            return wrapped, True
        return output, False
    if isinstance(output, (tuple, list, dict)):
        items = list(output.values()) if isinstance(output, dict) else list(output)
        slots = [i for i, t in enumerate(items) if _needs_grad(t)]
        if not slots:
            return output, False
        wrapped = _UseStart.apply(on_start, use, *(items[i] for i in slots))
        use.node = weakref.ref(wrapped[0].grad_fn)
        for i, t in zip(slots, wrapped):
            items[i] = t
        if isinstance(output, dict):
            if type(output) is dict:
                return dict(zip(output.keys(), items)), True
            return _rebuild_mapping(output, items), True
        return (type(output)(items) if type(output) in (tuple, list) else type(output)(*items)), True
    return output, False


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _rebuild_mapping(output: Any, items: list[Any]) -> Any:
    for key, value in zip(list(output.keys()), items):
        output[key] = value
    return output
