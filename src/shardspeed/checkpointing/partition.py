"""How a checkpointed region's inputs are kept between its forward and its recompute.

A checkpointed region keeps nothing but its inputs; this module decides what form they take:

- by default, the input itself (detached: the stored copy must not hold the graph that produced it);
- ``cpu_checkpointing``: a host-memory copy, moved back to the input's device for the recompute (on a CPU-only
  machine the "copy" is the tensor itself, so the option costs nothing there);
- ``partition_activations``: each tensor-axis rank keeps only its 1/N slice of the flattened input (padded so
  the slices are equal; gloo cannot gather uneven slices) and the recompute all-gathers the whole. This relies
  on the inputs being replicated across the tensor axis — true for the inputs of tensor-parallel blocks, whose
  activations are all-reduced before they leave a block, but not under sequence parallelism, where a block's
  input is this rank's sequence shard. So each rank also keeps a fingerprint of its whole input (the bits of its
  float64 sum) and sends it with its slice in the recompute's all-gather: every rank then sees every rank's
  fingerprint and, if they differ, raises the same error (Megatron refuses this combination up front; here it is
  caught without an extra collective, at the cost of one host read of the fingerprints per recompute);
- ``contiguous_memory_optimization`` (with partitioning): one checkpoint's slices of one dtype share a single
  buffer instead of one allocation each.

Only top-level positional and keyword tensors are stored this way; anything else (non-tensor arguments,
containers) is kept by reference. Parameters are always kept by reference: the module owns them, a copy would
add memory rather than save it, and under ZeRO-3 the module's hooks re-gather them during the recompute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.comm.collectives import Collectives
from shardspeed.faults.errors import mark_agreed
from shardspeed.topology import AxisGroup


@dataclass(frozen=True)
class StoragePlan:
    """The storage options of one checkpoint call (the relevant part of the activation-checkpointing config)."""

    partition: bool = False
    cpu: bool = False
    contiguous: bool = False


@dataclass
class StoredTensor:
    """One input tensor in its stored form, plus what is needed to rebuild it exactly."""

    data: torch.Tensor
    """The input (detached), its host copy, or this rank's flat slice of it."""
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    """Rebuilt inputs must match: autograd saves different tensors for inputs that do or don't need a gradient,
    and torch's checkpoint rejects a recompute that saves different tensors than the forward did."""
    partitioned: bool
    version: int | None
    """Version counter when ``data`` shares storage with the caller's tensor: a later in-place change would make
    the recompute silently wrong, so it is detected instead."""
    fingerprint: torch.Tensor | None = None
    """Partitioned only: the bits (one int64) of the whole input's float64 sum, compared across the tensor axis
    at the rebuild (a non-replicated input cannot be rebuilt from the ranks' slices)."""

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def rebuild(self, collectives: Collectives, axis: AxisGroup) -> torch.Tensor:
        """The input as it was at the forward, detached, with its original ``requires_grad``."""
        if self.version is not None and self.data._version != self.version:
            raise RuntimeError(
                "activation checkpointing: an input of a checkpointed region was modified in place after the "
                "region's forward; the recompute would use the modified values. Clone the input before changing it"
            )
        local = self.data.to(self.device, non_blocking=True) if self.data.device != self.device else self.data
        if self.partitioned:
            local = self._gather_checked(local, collectives, axis)
        return local.detach().requires_grad_(self.requires_grad)

    def _gather_checked(self, local: torch.Tensor, collectives: Collectives, axis: AxisGroup) -> torch.Tensor:
        """All-gather the slices, each followed by its rank's fingerprint; refuse (alike on every rank: every
        rank sees every fingerprint) an input that was not the same on every rank of the tensor axis."""
        assert self.fingerprint is not None
        n = local.numel()
        send = torch.cat([local.reshape(-1), self.fingerprint.to(local.device).view(local.dtype)])
        gathered = torch.empty(send.numel() * axis.size, dtype=local.dtype, device=self.device)
        collectives.all_gather(gathered, send, axis, tag="activation_checkpointing")
        rows = gathered.view(axis.size, -1)
        prints = rows[:, n:].contiguous().view(torch.int64).reshape(-1).tolist()
        if any(p != prints[0] for p in prints):
            differing = [axis.ranks[i] for i, p in enumerate(prints) if p != prints[0]]
            raise mark_agreed(
                ValueError(
                    f"partition_activations: an input of shape {tuple(self.shape)} to a checkpointed region differs "
                    f"across the tensor-parallel ranks {list(axis.ranks)} (ranks {differing} differ from rank "
                    f"{axis.ranks[0]}), so it cannot be rebuilt from their slices. Partitioning needs inputs "
                    "replicated over the tensor axis: turn partition_activations off under sequence parallelism, "
                    "or checkpoint regions whose inputs are replicated"
                )
            )
        return rows[:, :n].reshape(-1)[: self.shape.numel()].view(self.shape)


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The bits of ``tensor``'s float64 sum as one int64 (stays on the tensor's device: no sync at store time)."""
    return tensor.detach().double().sum().reshape(1).view(torch.int64)


def _should_partition(tensor: torch.Tensor, plan: StoragePlan, axis: AxisGroup) -> bool:
    # Integer inputs (token ids, masks) are small and exact; tiny tensors are not worth a collective.
    return plan.partition and axis.size > 1 and tensor.is_floating_point() and tensor.numel() >= axis.size


def _slice_bounds(numel: int, axis: AxisGroup) -> tuple[int, int]:
    """(start, length) of this rank's slice of a flat tensor of ``numel`` elements padded to equal slices."""
    length = -(-numel // axis.size)
    return axis.rank * length, length


def _store_one(tensor: torch.Tensor, plan: StoragePlan, axis: AxisGroup) -> StoredTensor:
    detached = tensor.detach()
    host = torch.device("cpu")
    if _should_partition(tensor, plan, axis):
        start, length = _slice_bounds(tensor.numel(), axis)
        flat = detached.reshape(-1)
        piece = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
        available = max(0, min(length, flat.numel() - start))
        piece[:available] = flat[start : start + available]  # a fresh buffer: the full input can be freed
        data = piece.to(host) if plan.cpu else piece
        return StoredTensor(
            data, tensor.shape, tensor.device, tensor.requires_grad, True, None, fingerprint=_fingerprint(detached)
        )
    if plan.cpu and tensor.device != host:
        return StoredTensor(detached.to(host), tensor.shape, tensor.device, tensor.requires_grad, False, None)
    return StoredTensor(detached, tensor.shape, tensor.device, tensor.requires_grad, False, detached._version)


def _pack_contiguous(stored: list[StoredTensor]) -> None:
    """Move the partitioned slices of one checkpoint into one buffer per (dtype, device); views replace them."""
    groups: dict[tuple[torch.dtype, torch.device], list[StoredTensor]] = {}
    for item in stored:
        if item.partitioned:
            groups.setdefault((item.data.dtype, item.data.device), []).append(item)
    for (dtype, device), items in groups.items():
        buffer = torch.empty(sum(i.data.numel() for i in items), dtype=dtype, device=device)
        offset = 0
        for item in items:
            view = buffer[offset : offset + item.data.numel()]
            view.copy_(item.data)
            item.data = view
            offset += view.numel()


def _keep_by_reference(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter)


class InputStore:
    """A checkpoint's positional and keyword arguments with their tensors in stored form."""

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], plan: StoragePlan, axis: AxisGroup) -> None:
        self._args = [a if _keep_by_reference(a) else _store_one(a, plan, axis) for a in args]
        self._kwargs = {k: v if _keep_by_reference(v) else _store_one(v, plan, axis) for k, v in kwargs.items()}
        if plan.contiguous:
            _pack_contiguous(self.stored_tensors)

    @property
    def stored_tensors(self) -> list[StoredTensor]:
        values = [*self._args, *self._kwargs.values()]
        return [v for v in values if isinstance(v, StoredTensor)]

    @property
    def nbytes(self) -> int:
        """Bytes this store holds (a contiguous buffer is counted once per view, which sums to its size)."""
        return sum(item.nbytes for item in self.stored_tensors)

    def rebuild(self, collectives: Collectives, axis: AxisGroup) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments for the recompute. Every tensor-axis rank must call this together (all-gathers)."""

        def one(value: Any) -> Any:
            return value.rebuild(collectives, axis) if isinstance(value, StoredTensor) else value

        return tuple(one(a) for a in self._args), {k: one(v) for k, v in self._kwargs.items()}
