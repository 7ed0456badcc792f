"""Keep autograd from pinning gathered parameters between forward and backward.

[Note: saved views] Autograd saves what backward needs. ``F.linear`` saves ``weight.t()`` — a *view* of the unit's
gathered buffer — so after the unit is released (its parameters pointed back at empty placeholders) that view
would keep the whole gathered buffer alive until backward: with plain ``nn.Linear`` every unit would stay in
memory for the whole step and ZeRO-3 would save nothing between forward and backward. DeepSpeed swaps in its own
linear function for this. Here, during the root module's forward, a ``saved_tensors_hooks`` pair replaces any
saved tensor that lives in a gathered (non-persistent) unit's buffer by a small reference (unit, offset, size,
stride); in backward the reference is resolved against the unit's buffer as re-gathered by its pre-backward hook.
No torch function is patched: this is the public saved-tensor hook API.

[Note: outer saved-tensor hooks] Saved-tensor hooks do not nest: autograd calls only the innermost pair. A pair
already active around the forward — the user's ``torch.autograd.graph.save_on_cpu``, the autotuner's
``SavedTensorCounter`` — would be silently switched off by ours. So ``enter`` reads the pair on top of the stack
(``torch._C._autograd._top_saved_tensors_default_hooks``, the stack ``saved_tensors_hooks`` pushes to) and every
saved tensor that is not a gathered parameter goes through it: packed by the outer pack hook, unpacked by its unpack
hook. Gathered-parameter views stay references (parameters are not activations: moving or counting them would be
wrong either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.zero.stage3.unit import ParamUnit, UnitState


@dataclass(frozen=True)
class _OuterPacked:
    """What the outer pack hook returned for a saved tensor, with the unpack hook of the same pair (a later
    forward may run under another pair before this one's backward) ([Note: outer saved-tensor hooks])."""

    packed: Any
    unpack: Any


@dataclass(frozen=True)
class UnitRef:
    unit: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class SavedViewHooks:
    """The pack/unpack pair, and entering/leaving it around one forward pass."""

    def __init__(self, units: Sequence[ParamUnit]) -> None:
        self.units = list(units)
        self._active: Any = None
        self._outer: tuple[Any, Any] | None = None  # the pair active around the forward, if any

    def pack(self, tensor: torch.Tensor) -> Any:
        # Tensors kept as they are go back detached: a pack hook returning the tensor itself closes a reference
        # cycle for a node that saves its own output (tanh, relu: node → saved tensor → its grad_fn → node) that
        # no garbage collector sees, so a graph whose backward never runs (a forward with grad but no backward)
        # would keep its activations alive for good. Autograd re-attaches the history on unpack.
        if tensor.layout is not torch.strided or tensor.device.type == "meta":
            return tensor.detach()
        ptr = tensor.untyped_storage().data_ptr()
        for index, unit in enumerate(self.units):
            full = unit.full
            if unit.persistent or full is None or unit.state is not UnitState.UNSHARDED:
                continue
            if full.untyped_storage().data_ptr() == ptr:
                return UnitRef(index, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))
        if self._outer is not None:
            return _OuterPacked(self._outer[0](tensor), self._outer[1])
        return tensor.detach()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _OuterPacked):
            return packed.unpack(packed.packed)
        if not isinstance(packed, UnitRef):
            return packed
        unit = self.units[packed.unit]
        unit.ensure_unsharded()  # normally done already by the unit's pre-backward hook
        assert unit.full is not None
        return unit.full.as_strided(packed.size, packed.stride, packed.offset)

    def enter(self) -> None:
        self.leave()  # a forward that raised never reached its post-hook: drop the stale context first
        if torch.is_grad_enabled():
            self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            self._active = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._active.__enter__()

    def leave(self) -> None:
        if self._active is not None:
            active, self._active = self._active, None
            active.__exit__(None, None, None)
