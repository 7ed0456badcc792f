"""What a model needs around the tensor-parallel layers under sequence parallelism (Megatron-SP).

[Note: sequence-parallel regions] With ``tp.sequence_parallel`` the activations *between* tensor-parallel regions —
what layer norms, dropout and residual adds see — are split along the sequence dim over the tensor axis instead of
replicated. The linear layers do the switching inside a block (a column-parallel layer all-gathers its input, a
row-parallel layer reduce-scatters its output: ``layers.py``); the model does the rest:
- enter the region once, after the embedding (``enter_sequence_parallel``: keep this rank's sequence chunk; the
  backward all-gathers the gradient, so the replicated embedding gets its whole gradient on every rank);
- leave it once, before the head (``leave_sequence_parallel``): all-gather the sequence; in backward either keep
  this rank's chunk of the gradient (a replicated head and loss: every rank computed the same full gradient) or
  reduce-scatter it (a tensor-parallel head, e.g. vocab-parallel logits: each rank holds a partial gradient);
- declare every replicated parameter used inside the region as having a *partial* gradient: a layer norm's weight
  sees only this rank's tokens, so its gradient is this rank's share of the sum. ``SequenceParallel(norm, tp)``
  wraps a module and declares all its parameters so (``ParamSpec(partial_grad=True)``); a block that prefers to
  keep its state-dict keys unchanged returns ``partial_grad_specs(self.ln_1, "ln_1", self.tp)`` from its own
  ``tensor_parallel_specs()`` instead. The engine sums those gradients over the tensor axis
  (``partial_grads.py``) before ZeRO sees them. The row-parallel bias declares itself.
Dropout inside the region must draw different masks per tensor rank (each rank holds different tokens):
``SequenceParallelDropout`` (``TensorParallelDropout(region="sequence")``) draws from the model-parallel stream of
the RNG tracker (``shardspeed.checkpointing``: seeded per tensor rank by ``model_parallel_manual_seed``), and from the
default stream — identical on every rank, as replicated activations need — when sequence parallelism is off.
Without sequence parallelism every function here is the identity and every declaration is an ordinary replicated
spec, so one model definition serves both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.checkpointing import RNGStatesTracker
from shardspeed.params.spec import ParamSpec
from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.tensor_parallel.mappings import gather_from_sequence_region, scatter_to_sequence_region
from shardspeed.tensor_parallel.random import TensorParallelDropout

__all__ = [
    "SequenceParallel",
    "SequenceParallelDropout",
    "enter_sequence_parallel",
    "leave_sequence_parallel",
    "partial_grad_specs",
]


def enter_sequence_parallel(x: torch.Tensor, tp: TensorParallel, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of the sequence dim (``dim``: 1 for ``[b, s, h]``) under sequence parallelism, else ``x``.
    The sequence length must be divisible by the tensor-parallel size."""
    return scatter_to_sequence_region(x, tp, dim) if tp.sequence_parallel else x


def leave_sequence_parallel(
    x: torch.Tensor, tp: TensorParallel, dim: int = 1, *, consumer_is_tensor_parallel: bool = False
) -> torch.Tensor:
    """The whole sequence again (all-gather) under sequence parallelism, else ``x``.
    ``consumer_is_tensor_parallel``: the next layer is sliced over the tensor axis (its input gradient is partial,
    so the backward reduce-scatters); otherwise it is replicated (the backward keeps this rank's chunk)."""
    if not tp.sequence_parallel:
        return x
    return gather_from_sequence_region(
        x, tp, dim, tensor_parallel_output_grad=consumer_is_tensor_parallel, tag="sp.leave"
    )


def partial_grad_specs(module: nn.Module, prefix: str, tp: TensorParallel) -> dict[str, ParamSpec]:
    """Specs declaring every parameter of ``module`` (a child reached as ``prefix``; "" for the declaring module
    itself) replicated with a partial gradient under sequence parallelism. Empty without it (or at TP=1), so
    the parameters stay ordinary replicated ones."""
    if not (tp.sequence_parallel and tp.size > 1):
        return {}
    head = f"{prefix}." if prefix else ""
    return {f"{head}{name}": ParamSpec(tuple(p.shape), partial_grad=True) for name, p in module.named_parameters()}


class SequenceParallel(nn.Module):
    """A replicated module (layer norm, RMSNorm, a bias) run on sequence shards: forwards to ``module`` and declares
    its parameters' gradients partial over the tensor axis ([Note: sequence-parallel regions]). Its state-dict keys
    gain ``module.``; use ``partial_grad_specs`` from the enclosing block to keep them."""

    def __init__(self, module: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.module = module
        self.tp = tp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return partial_grad_specs(self.module, "module", self.tp)


class SequenceParallelDropout(TensorParallelDropout):
    """Dropout on the residual stream of a block ([Note: sequence-parallel regions]): ``TensorParallelDropout``
    with ``region="sequence"``. Under sequence parallelism each tensor rank holds different tokens, so the mask is
    drawn inside ``tracker.fork()`` (the model-parallel stream, seeded per tensor rank); otherwise the activations
    are replicated and the mask comes from the default stream, the same on every rank. ``tracker``: None for
    ``tp.tracker``, else the default context's (looked up at each call, so a later ``model_parallel_manual_seed``
    is seen)."""

    def __init__(self, p: float, tp: TensorParallel, tracker: RNGStatesTracker | None = None) -> None:
        super().__init__(p, tracker, "sequence", tp)
