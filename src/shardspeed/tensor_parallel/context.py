"""What a tensor-parallel layer communicates over: the tensor axis and the ``Collectives`` it goes through.

A model is built before the engine exists, so layers are given a ``TensorParallel`` made from the topology
(``TensorParallel.from_topology``); its collectives start as a private, unlogged ``Collectives``. When an engine
wraps the model it *binds* every ``TensorParallel`` it finds to its own collectives (``bind_collectives``), so
tensor-parallel traffic shows in the engine's comms log and waits through its failure board like every other
collective. Nothing here is module-level state: each layer holds the object it was built with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from shardspeed.comm import Collectives
from shardspeed.topology import AxisGroup

if TYPE_CHECKING:
    from shardspeed.checkpointing.rng import RNGStatesTracker
    from shardspeed.topology import Topology


class TensorParallel:
    """The tensor axis of one model replica. ``sequence_parallel``: activations between tensor-parallel regions
    are split along the sequence dim (Megatron-SP) instead of replicated. ``tracker``: the RNG tracker whose
    model-parallel stream the layers' dropout in split regions draws from when they were given none (None: the
    ``shardspeed.checkpointing`` default context's); the engine finds it here to save it in checkpoints."""

    def __init__(
        self,
        axis: AxisGroup,
        collectives: Collectives | None = None,
        *,
        sequence_parallel: bool = False,
        tracker: RNGStatesTracker | None = None,
    ) -> None:
        self.axis = axis
        self.collectives = collectives or Collectives()
        self.sequence_parallel = sequence_parallel
        self.tracker = tracker

    @classmethod
    def from_topology(
        cls, topology: Topology, *, sequence_parallel: bool = False, tracker: RNGStatesTracker | None = None
    ) -> TensorParallel:
        return cls(topology.tensor, sequence_parallel=sequence_parallel, tracker=tracker)

    @property
    def rank(self) -> int:
        return self.axis.rank

    @property
    def size(self) -> int:
        return self.axis.size

    def bind(self, collectives: Collectives) -> None:
        """Communicate through ``collectives`` from now on (the engine's: logged, interruptible)."""
        self.collectives = collectives


def tensor_parallel_contexts(module: nn.Module) -> list[TensorParallel]:
    """Every distinct ``TensorParallel`` the layers of ``module`` hold (as their ``tp`` attribute)."""
    seen: dict[int, TensorParallel] = {}
    for sub in module.modules():
        tp = getattr(sub, "tp", None)
        if isinstance(tp, TensorParallel):
            seen.setdefault(id(tp), tp)
    return list(seen.values())


def bind_collectives(module: nn.Module, collectives: Collectives, tensor_axis: AxisGroup) -> None:
    """Bind every layer's ``TensorParallel`` to the engine's collectives; a layer built on another tensor axis
    than the engine's topology is an error naming both."""
    for tp in tensor_parallel_contexts(module):
        if tuple(tp.axis.ranks) != tuple(tensor_axis.ranks):
            raise ValueError(
                f"the model's tensor-parallel layers were built on tensor ranks {list(tp.axis.ranks)}, but the "
                f"engine's topology has tensor ranks {list(tensor_axis.ranks)}: build the model with the topology "
                "passed to initialize (mpu=topology), or let tensor_parallel.autotp_size slice it"
            )
        tp.bind(collectives)
