"""The protocol between the engine and an optimizer that owns its communication (1-bit Adam and its kin).

[Note: optimizer-owned communication] DeepSpeed's 1-bit optimizers switch the engine's gradient all-reduce off
once their warm-up ends (``engine.enable_backward_allreduce = False``) and communicate the *momentum* themselves,
compressed. Here the switch is a question the stage asks, never an attribute the optimizer sets on the engine:

1. The engine builds the optimizer (config ``optimizer.type`` or a client instance) and, before the first step,
   calls ``bind(collectives, axis)`` once (``compression/engine_wiring.py``): the axis is the data axis, the
   collectives the engine's own (logged, failure board, order check).
2. Before every backward the stage's gradient sync asks ``owns_communication``. False (warm-up): the ordinary
   bucketed all-reduce runs, the optimizer sees mean gradients. True (compressed phase): no gradient collective
   runs at all; each rank's optimizer sees its *local* gradient, already scaled by 1/GAS (the flat buffer
   accumulates the micro-steps as usual). The answer changes only inside ``step()``, and only as a function of
   the step count, so it is the same on every rank at every backward.
3. ``step()`` communicates through the bound ``Collectives`` (e.g. ``CompressedAllReduce`` of the momentum);
   every rank ends the step with identical parameters.
4. Checkpoints: ``compression_state_dict()`` is this rank's error-feedback state (flat tensors; ranks differ),
   ``load_compression_state_dict(sd, same_world)`` puts it back — or, at another data-parallel world size, resets
   it with one warning (the buffers' chunks follow the world size). The phase itself is not saved apart: it
   follows from the per-parameter ``step`` counts, saved with the optimizer's other states.

What the step core must agree on in the compressed phase ([Note: agreed step] in training/step_core.py): local
gradients differ between ranks, so the norm (fp16 overflow, clipping, a report) is one scalar all-reduce of the
local sums of squares over the data axis (``zero/replicated.py``); the reported norm and the clip coefficient
then use the root mean square of the ranks' local norms, one value everywhere (DeepSpeed clips each rank's local
gradient by its own local norm). Where nothing needs the norm, only the non-finite verdict is agreed, inside the
step checks' all-reduce ([Note: agreed step]).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from shardspeed.comm import Collectives
from shardspeed.topology import AxisGroup

logger = logging.getLogger("shardspeed")


def trained(params: Any) -> list[Tensor]:
    """The tensors a 1-bit optimizer steps: all but frozen ``nn.Parameter``s (``requires_grad`` False: LoRA's base
    weights, which the engine hands over with the rest, as DeepSpeed's does). The fp32 masters the engine swaps in
    under bf16/fp16 are plain tensors without ``requires_grad`` and are stepped. A frozen parameter is frozen on
    every rank alike, so leaving it out keeps the ranks' collectives identical; it gets no state, takes no part in
    any mean and no weight decay (DeepSpeed's optimizers skip it through its missing ``.grad``). A *trainable*
    parameter without a gradient this step still takes part: another rank may have one."""
    return [p for p in params if p.requires_grad or not isinstance(p, torch.nn.Parameter)]


def mask_exp_avg_(group: dict[str, Any], tensor: Tensor) -> None:
    """DeepSpeed's ``exp_avg_mask`` param-group key: multiply the averaged momentum (or what becomes it) by the
    group's mask after a compressed mean. 1-bit compression cannot send an exact zero, so momentum that should
    stay zero (BERT's unused position-embedding rows) would otherwise accumulate compression error. The mask
    broadcasts against each parameter of its group (DeepSpeed's rule), and moves to the tensor's device once."""
    mask = group.get("exp_avg_mask")
    if mask is None:
        return
    if mask.device != tensor.device:
        group["exp_avg_mask"] = mask = mask.to(tensor.device)
    tensor.mul_(mask)


class CompressedOptimizer(torch.optim.Optimizer):
    """Base class of optimizers that own communication after a warm-up ([Note: optimizer-owned communication]).

    Subclasses implement ``step`` and ``owns_communication`` and create their compressors with
    ``compressor(key, numel)`` (one flat buffer) or ``partwise_compressor(key, sizes)`` (several tensors, each
    compressed apart: OneBitAdam's parameters); the base keeps them, binds them to the engine's collectives and
    saves/loads/resets their error buffers.
    """

    shardspeed_owns_communication = True  # what engine wiring and the step core look for (inherited by subclasses)

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._collectives: Collectives | None = None
        self._axis: AxisGroup | None = None
        self._device: torch.device | None = None
        self._compressors: dict[str, Any] = {}
        self._workspace: Any = None  # work buffers every compressor shares (compression/collective.py: Workspace)
        self._pending_state: dict[str, dict[str, Tensor]] = {}  # loaded before the compressor exists

    # --- the engine's side ---------------------------------------------------------------------------------------
    def bind(self, collectives: Collectives, axis: AxisGroup, device: torch.device | None = None) -> None:
        """The engine's collectives and the axis gradients would be averaged over (its data axis). Called once,
        before the first step. An optimizer never bound (used outside an engine) runs as on a world of one: every
        mean is the identity, no collective, no error buffers."""
        if self._collectives is not None and (self._collectives is not collectives or self._axis is not axis):
            raise RuntimeError(f"{type(self).__name__} is already bound to another engine's collectives")
        self._collectives, self._axis = collectives, axis
        self._device = device

    @property
    def bound(self) -> bool:
        return self._collectives is not None

    @property
    def axis(self) -> AxisGroup:
        if self._axis is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to an engine: call bind(collectives, axis) first")
        return self._axis

    @property
    def owns_communication(self) -> bool:
        """True once the compressed phase runs: the engine then reduces no gradients ([Note: optimizer-owned
        communication]). Must be a function of state every rank shares (the step count)."""
        raise NotImplementedError

    # --- compressors ---------------------------------------------------------------------------------------------
    def compressor(self, key: str, numel: int) -> Any:
        """The error-fed compressed all-reduce (MEAN over the bound axis) for the flat buffer ``key`` of ``numel``
        fp32 elements, created on first use (its error buffers start at zero, or from a loaded checkpoint)."""
        from shardspeed.compression.collective import CompressedAllReduce

        return self._get_compressor(key, lambda c, device, tag, ws: CompressedAllReduce(
            numel, self.axis, c, device=device, tag=tag, workspace=ws
        ))  # fmt: skip

    def partwise_compressor(self, key: str, sizes: list[int]) -> Any:
        """``compressor`` for several tensors of ``sizes`` compressed each apart in one set of collectives
        (``PartwiseCompressedAllReduce``, [Note: partwise compressed all-reduce])."""
        from shardspeed.compression.partwise import PartwiseCompressedAllReduce

        return self._get_compressor(key, lambda c, device, tag, ws: PartwiseCompressedAllReduce(
            sizes, self.axis, c, device=device, tag=tag, workspace=ws
        ))  # fmt: skip

    def _get_compressor(self, key: str, build: Any) -> Any:
        comp = self._compressors.get(key)
        if comp is None:
            from shardspeed.compression.collective import Workspace

            if self._collectives is None:
                raise RuntimeError(f"{type(self).__name__} is not bound to an engine: call bind(collectives, axis)")
            device = self._device or torch.device("cpu")
            if self._workspace is None:
                self._workspace = Workspace(device)
            comp = build(self._collectives, device, f"compressed:{key}", self._workspace)
            pending = self._pending_state.pop(key, None)
            if pending is not None:
                comp.load_state_dict(pending)
            self._compressors[key] = comp
        return comp

    @property
    def error_bytes(self) -> int:
        """Bytes held by every compressor's error buffers on this rank (memory figures)."""
        return sum(int(c.error_bytes) for c in self._compressors.values())

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping each group's current ``exp_avg_mask`` (DeepSpeed's
        rule: the mask may change between training stages, so a saved one is never restored)."""
        groups = [dict(g) for g in state_dict["param_groups"]]
        for group, saved in zip(self.param_groups, groups):
            saved.pop("exp_avg_mask", None)
            if "exp_avg_mask" in group:
                saved["exp_avg_mask"] = group["exp_avg_mask"]
        super().load_state_dict({**state_dict, "param_groups": groups})

    def compression_state_dict(self) -> dict[str, Tensor]:
        """This rank's error-feedback state, flat tensors keyed ``"<buffer key>/<name>"`` (empty in warm-up)."""
        out: dict[str, Tensor] = {}
        for key, comp in sorted(self._compressors.items()):
            for name, tensor in comp.state_dict().items():
                out[f"{key}/{name}"] = tensor
        for key, state in sorted(self._pending_state.items()):  # loaded, not used yet: saved again as loaded
            for name, tensor in state.items():
                out[f"{key}/{name}"] = tensor
        return out

    def load_compression_state_dict(self, state: dict[str, Tensor], same_world: bool) -> None:
        """Put back what ``compression_state_dict`` saved; ``same_world`` False: reset instead (the caller warns:
        the buffers' chunks follow the data-parallel world size)."""
        self.reset_compression()
        if not same_world:
            return
        grouped: dict[str, dict[str, Tensor]] = {}
        for full, tensor in state.items():
            key, _, name = full.rpartition("/")
            grouped.setdefault(key, {})[name] = tensor
        for key, tensors in grouped.items():
            comp = self._compressors.get(key)
            if comp is not None:
                comp.load_state_dict(tensors)
            else:  # created at the next compressed step (its size is known then)
                self._pending_state[key] = tensors

    def drop_unclaimed_compression_state(self) -> None:
        """After a compressed step has created every compressor it uses: error buffers loaded under keys no
        compressor claimed (a checkpoint from another buffer layout, e.g. an older release's one buffer per param
        group) are dropped with a warning instead of lingering, and the compressors run from zero errors."""
        if self._pending_state:
            logger.warning(
                "%s: the checkpoint's error-feedback buffers %s match no compressor of this run (another buffer "
                "layout); they are dropped and the compression errors restart at zero",
                type(self).__name__,
                sorted(self._pending_state),
            )
            self._pending_state = {}

    def reset_compression(self) -> None:
        """Forget every error buffer (they restart at zero at the next compressed step)."""
        for comp in self._compressors.values():
            comp.reset()
        self._pending_state = {}
