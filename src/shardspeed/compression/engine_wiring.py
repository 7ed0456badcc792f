"""Engine wiring for optimizers that own communication ([Note: optimizer-owned communication] in optim_base.py):
the checks of what they run under, ``bind``, and the stage-0 gradient sync that stops reducing once the
optimizer communicates itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.topology import Topology


def owns_communication(optimizer: Any) -> bool:
    """Whether ``optimizer`` (any object) owns communication now; False for every ordinary optimizer."""
    return bool(getattr(type(optimizer), "shardspeed_owns_communication", False)) and optimizer.owns_communication


def check_compressed_setup(config: Any, optimizer: Any, topology: Topology) -> None:
    """What a 1-bit optimizer (any of DeepSpeed's three, at any stage) cannot run under: one clear error, raised
    alike on every rank (it follows from the config and the mesh), before the stage and element-wise checks, so
    the message names the real obstacle. ZeRO-1/2's sharded OneBitAdam included: with an offloaded optimizer its
    compressed gradient path would step the wrong tensors, and a tensor or pipeline axis is untested."""
    from shardspeed.zero.compressed_grads import check_compression_combination, compressed_optimizer_name

    name = compressed_optimizer_name(optimizer)
    if name is None:
        return
    _refuse_mesh_and_offload(name, config, topology)
    check_compression_combination(optimizer, config.zero_optimization.stage)


def _refuse_mesh_and_offload(name: str, config: Any, topology: Topology) -> None:
    """The two setups no 1-bit optimizer runs under: a tensor or pipeline axis, an offloaded optimizer."""
    zero = config.zero_optimization
    if topology.tensor.size > 1 or topology.pipe.size > 1:
        raise NotImplementedError(
            f"{name} with a tensor or pipeline axis (mesh pipe {topology.pipe.size} × data {topology.data.size} × "
            f"tensor {topology.tensor.size}) is not supported: 1-bit optimizers run over the data axis only"
        )
    if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none":
        raise NotImplementedError(f"{name} with zero_optimization.offload_optimizer is not supported")


def bind_compressed_optimizer(
    config: Any, states: Any, optimizer: Any, topology: Topology, collectives: Collectives, device: torch.device
) -> None:
    """An optimizer that owns communication: refuse what it cannot run under (clear errors, raised alike on every
    rank: they follow from the config and the mesh), bind it to the data axis, let the stage skip its gradient
    reduction when the optimizer says so. Anything else: nothing."""
    if not getattr(type(optimizer), "shardspeed_owns_communication", False):
        return
    name = type(optimizer).__name__
    _refuse_mesh_and_offload(name, config, topology)
    zero = config.zero_optimization
    let = getattr(states, "let_optimizer_communicate", None)
    if let is None:
        raise NotImplementedError(f"{name} under ZeRO stage {zero.stage} is not supported (stage 0 only)")
    optimizer.bind(collectives, topology.data, device)
    let(lambda: optimizer.owns_communication)


class OptimizerOwnedGrads:
    """A stage's ``GradSync`` that reduces only while the optimizer does not own communication.

    Decided per backward (``owns`` cannot change inside one: it changes in ``optimizer.step()``): in the
    compressed phase ``launch`` issues nothing (a finished ``Work``) and ``complete`` neither copies nor scales,
    so the flat buffer keeps this rank's local sum of 1/GAS-scaled micro-step gradients, which is what
    DeepSpeed's 1-bit optimizers step on with ``enable_backward_allreduce`` off. Everything else (absorbing,
    holding, zeroing, ``reopen``) is the wrapped sync's.
    """

    def __init__(self, inner: Any, owns: Callable[[], bool]) -> None:
        self.inner, self.owns = inner, owns
        self._local: set[int] = set()  # buckets launched without communication, until completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def launch(self, k: int) -> Work:
        if self.owns():
            self._local.add(k)
            return Work(None)
        return self.inner.launch(k)

    def complete(self, k: int) -> None:
        if k in self._local:
            self._local.discard(k)
            return
        self.inner.complete(k)
