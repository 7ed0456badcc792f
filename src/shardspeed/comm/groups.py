"""Small helpers about process groups for ``Collectives``: what a wait was doing, where a host-made tensor must
live, which group an order check runs on."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardspeed.topology import AxisGroup


def describer(op: str, tag: str, axis: AxisGroup) -> Callable[[], str]:
    """What a wait was doing, built only for an error message (this runs for every collective)."""
    return lambda: f"waiting in {op}{f' {tag!r}' if tag else ''} over the {axis.name} axis (ranks {list(axis.ranks)})"


def device_for(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small host-made tensor must live to cross ``group``: NCCL moves device tensors only."""
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def check_group(axis: AxisGroup) -> dist.ProcessGroup | None:
    """Where an order check runs: ``WORLD`` for a group of every rank, so ranks that diverged onto two such groups
    still meet in one exchange ([Note: collective-order verification])."""
    return dist.group.WORLD if axis.size == dist.get_world_size() else axis.group
