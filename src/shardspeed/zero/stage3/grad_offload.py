"""ZeRO-3's half of gradients on NVMe (ZeRO-Infinity): each unit's reduced shard is written behind to the
optimizer's swap file as soon as its reduce-scatter completes, and freed.

[Note: gradients on NVMe] With ``offload_optimizer.device: "nvme"`` (``offload_gradients``, the default; every
chunk offloaded, ``ratio`` 1) a unit's fp32 gradient shard exists in memory only from the launch of its
reduce-scatter until its write is done: ``UnitGrads`` allocates it at ``launch``, adds the reduced pieces, and at
``finish`` hands it to ``UnitGradSink.write``, which cuts it into the unit's stepped tensors and those into the
optimizer's chunks (``GradSwap``, offload/grad_swap.py: key ``<chunk>/grad`` next to the chunk's states). Host
memory for gradients is then the reduce-scatters in flight (``REDUCE_SCATTERS_IN_FLIGHT`` units) plus the
write-behind window, independent of model size; the streamed step reads each chunk's gradient with its states.

- The norm and the non-finite check see every gradient: the unit's squared sums are computed as it is written,
  one per counted view exactly as ``grad_sq_sum`` cuts them, and the step adds them in unit order, so the norm is
  bit-for-bit the in-memory path's. ``nonfinite_grad_names`` (only after a non-finite norm) reads shards back.
- Gradient accumulation (GAS > 1: stage 3 reduce-scatters every micro-step): accumulated in the swap file. A unit
  written earlier in this step is read back into its fresh shard at ``launch`` (the read overlaps the reduce-
  scatter; the first reduced piece waits for it), the pieces are added, and the sum is written behind again —
  the same additions in the same order as the in-memory shard, so the result is identical. Costs one read per
  unit per micro-step after the first; memory stays a few units.
- Cleared gradients (``zero_grad`` between backward passes) forget the unit's chunks (read as zeros); a cleared
  single parameter is read back, zeroed and rewritten.
- I/O failures in backward are deferred to the agreed step ([Note: deferred gradient I/O failures]).
- Checkpoints never hold gradients, so nothing here is saved.
- The stepped tensors' ``.grad`` are stand-ins (zeros), so whoever reads or writes a stepped tensor's gradient
  outside the step goes through ``read_tensor`` / ``write_tensor`` (the ``safe_*_grad`` accessors,
  utils/safe_access.py). A write rewrites the tensor's unit, so its squared sums (the norm) are recomputed and
  ``nonfinite_grad_names`` reads the new values back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardspeed.offload.grad_swap import GradSwap
from shardspeed.offload.stream import Handle
from shardspeed.precision.norm_weights import NormScope, counted_views
from shardspeed.zero.stage3.unit import ParamUnit

UnitTensors = dict[int, list[tuple[torch.Tensor, int, int]]]
"""unit index → its stepped tensors with the unit-flat range [lo, hi) each covers (Stage3States._unit_tensors)."""


class UnitGradSink:
    """Writes, reads back and forgets units' reduced gradient shards in a ``GradSwap``; keeps their norm parts."""

    def __init__(
        self,
        swap: GradSwap,
        units: Sequence[ParamUnit],
        unit_tensors: UnitTensors,
        trainable: Sequence[set[int]],
        scope: Callable[[], NormScope],
    ) -> None:
        self.swap, self.units, self.unit_tensors = swap, list(units), unit_tensors
        self.trainable = list(trainable)
        self.scope = scope
        self.sq_parts: dict[int, list[torch.Tensor]] = {}  # unit → its counted views' Σ g² at its last write
        # gradients of stepped tensors the optimizer does not step (trainable parameters left out of
        # model_parameters): never read by the step, but they count in the norm and accumulate over micro-steps,
        # so they are kept in memory (what the in-memory path holds for them), keyed by (unit, shard-local start)
        self.unstepped: dict[tuple[int, int], torch.Tensor] = {}
        # id(stepped tensor) → (its unit, shard-local a, b): the accessors' way from a tensor to its unit
        self._where = {id(t): (u, a, b) for u in self.unit_tensors for t, a, b in self._slices(u)}
        self.live_bytes = 0  # shards allocated and not yet handed to the swap
        self.peak_bytes = 0  # peak of live shards + writes in flight

    def _slices(self, u: int) -> list[tuple[torch.Tensor, int, int]]:
        """(stepped tensor, shard-local a, b) of unit ``u``."""
        start = self.units[u].rank_start
        return [(t, lo - start, hi - start) for t, lo, hi in self.unit_tensors.get(u, [])]

    # --- a unit's shard in memory ---------------------------------------------------------------------------------
    def allocated(self, nbytes: int) -> None:
        self.swap.retire_done()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.swap.in_flight_bytes)

    def has(self, u: int) -> bool:
        return any(self.swap.has(t) or (u, a) in self.unstepped for t, a, _ in self._slices(u))

    def read_back(self, u: int, shard: torch.Tensor) -> list[Handle]:
        """Start reading unit ``u``'s gradient of this step into ``shard`` (zeros where none was written). A device
        shard is filled through a host copy, synchronously (untested: no GPU was available)."""
        if shard.device.type != "cpu":
            host = torch.zeros(shard.numel(), dtype=shard.dtype)
            self.swap.wait_deferred(self.read_back(u, host))
            shard.copy_(host)
            return []
        handles: list[Handle] = []
        for tensor, a, b in self._slices(u):
            kept = self.unstepped.get((u, a))
            if kept is not None:
                shard[a:b].copy_(kept)
            else:
                handles += self.swap.read_into(tensor, shard[a:b])
        return handles

    def write(self, u: int, shard: torch.Tensor) -> None:
        """Unit ``u``'s reduced shard is complete: keep its norm parts, write it behind; the caller drops it."""
        unit = self.units[u]
        excluded = self.scope().excluded
        spans = [
            (unit.offsets[i], unit.offsets[i] + unit.numels[i]) for i in self.trainable[u] if unit.names[i] in excluded
        ]
        views = counted_views([shard], [(unit.rank_start, unit.rank_start + unit.shard_numel)], spans)
        self.sq_parts[u] = [torch.linalg.vector_norm(v, dtype=torch.float32).square() for v in views]
        self.live_bytes -= shard.numel() * shard.element_size()
        if shard.device.type != "cpu":  # the swap file takes host memory: one copy (untested: no GPU was available)
            shard = shard.to("cpu")
        for tensor, a, b in self._slices(u):
            if self.swap.chunks(tensor):
                self.swap.write(tensor, shard[a:b])
            else:
                self.unstepped[(u, a)] = shard[a:b].clone()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.swap.in_flight_bytes)

    # --- the step ---------------------------------------------------------------------------------------------------
    def sq_sum(self, device: torch.device | None) -> torch.Tensor:
        """Σ g² over every unit written this step, added in unit order as ``sum_of_squares`` adds its views."""
        total: torch.Tensor | None = None
        for u in sorted(self.sq_parts):
            for part in self.sq_parts[u]:
                total = part if total is None else total + part
        return total.reshape(1) if total is not None else torch.zeros(1, device=device)

    def read_shard(self, u: int) -> torch.Tensor:
        """Unit ``u``'s gradient shard of this step, read back (blocking; zeros outside its stepped tensors)."""
        shard = torch.zeros(self.units[u].shard_numel)
        self.swap.wait_deferred(self.read_back(u, shard))
        return shard

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of this stage's stepped tensors (its gradient is here, not in its ``.grad``)."""
        return id(tensor) in self._where

    def read_tensor(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The stepped ``tensor``'s gradient of this step (1-D, blocking; zeros where none was written), or None if
        it is not one of this stage's stepped tensors. A failed read reads as zeros and is raised by the step
        ([Note: deferred gradient I/O failures]): the accessors are collective, so no rank raises alone."""
        where = self._where.get(id(tensor))
        if where is None:
            return None
        u, a, b = where
        kept = self.unstepped.get((u, a))
        if kept is not None:
            return kept.clone()
        out = torch.zeros(b - a)
        self.swap.wait_deferred(self.swap.read_into(tensor, out))
        return out

    def write_tensor(self, tensor: torch.Tensor, offset: int, values: torch.Tensor) -> None:
        """Replace ``tensor``'s gradient at [offset, offset + len(values)) by ``values``: its unit is read back,
        changed and written again, so the unit's squared sums match the new values."""
        u, a, _ = self._where[id(tensor)]
        shard = self.read_shard(u)
        shard[a + offset : a + offset + values.numel()].copy_(values.reshape(-1))
        self.allocated(shard.numel() * shard.element_size())
        self.write(u, shard)

    def forget(self, u: int) -> None:
        """Unit ``u`` holds no gradient now (zero_grads, the step is over)."""
        self.swap.forget([c.name for t, _, _ in self._slices(u) for c in self.swap.chunks(t)])
        self.sq_parts.pop(u, None)
        for _, a, _ in self._slices(u):
            self.unstepped.pop((u, a), None)

    def forget_range(self, u: int, a: int, b: int) -> None:
        """Zero shard-local [a, b) of unit ``u``'s stored gradient (one parameter cleared by user code)."""
        if not self.has(u):
            return
        shard = self.read_shard(u)
        shard[a:b].zero_()
        self.allocated(shard.numel() * shard.element_size())
        self.write(u, shard)
