"""Layer specifications: a layer described by its class and arguments, built only on the stage that owns it.

``LayerSpec(nn.Linear, 16, 16)`` is DeepSpeed's building block: a ``PipelineModule`` keeps the list of specs on
every rank (so every rank computes the same partition from them, ``partition.py``) and calls ``build()`` only for
the layers of its own stage, so a model too big for one device never exists whole anywhere.

``TiedLayerSpec(key, ...)`` is a layer whose weights are shared by every occurrence of ``key`` (an embedding and
the LM head): each stage holding any occurrence builds *one* module for the key (``tied_modules.{key}``), and the
stages holding it keep their copies equal (``tied.py``). A later occurrence may run the same module differently
through ``forward_fn(module, x)`` (the head's ``x @ embedding.weight.T``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardspeed.params.spec import SpecProvider

__all__ = ["LayerSpec", "TiedLayerSpec", "layer_class_name", "trainable_numel"]


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built by ``build()`` (an ``nn.Module`` subclass only)."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec takes an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """A new module from the stored specification (``log`` is accepted for DeepSpeed's signature)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are one weight across every occurrence of ``key``.

    ``forward_fn(module, x)``, if given, is how *this* occurrence runs the shared module (default: ``module(x)``).
    ``tied_weight_attr`` names the shared parameters (dotted paths allowed: ``"linear.weight"``)."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"TiedLayerSpec key {key!r}: expected a non-empty string without dots (a module name)")
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs:
            raise ValueError(f"TiedLayerSpec '{key}': tied_weight_attr is empty")
        self.tied_weight_attr: list[str] = attrs

    def __repr__(self) -> str:
        return f"Tied[{self.key}]:{super().__repr__()}"


def layer_class_name(layer: Any) -> str:
    """The class name a layer is matched by (``type:REGEX`` partitioning, ``checkpointable_layers``): the spec's
    type, a module's class, or a function's ``__name__``."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def trainable_numel(layer: Any) -> int:
    """Trainable parameter count of one layer entry, without allocating its weights: a spec is built on the meta
    device (on the CPU with the RNG state restored if the class cannot be built on meta), a module is counted as
    it is, a plain callable counts 0; tensor-parallel slices count their global size. Pure: every rank gets the
    same number from the same spec."""
    if isinstance(layer, LayerSpec):
        with torch.random.fork_rng(devices=[]):  # building must not move the caller's RNG (seed_layers=False)
            try:
                with torch.device("meta"):
                    module = layer.build()
            except Exception:  # a layer whose constructor computes on its weights: count a real build
                module = layer.build()
        return _global_trainable_numel(module)
    if isinstance(layer, nn.Module):
        return _global_trainable_numel(layer)
    return 0


def _global_trainable_numel(module: nn.Module) -> int:
    """Trainable elements of the *global* tensors: a tensor-parallel slice counts as its whole parameter (its
    ``ParamSpec.global_shape``), so every tensor rank — whose slices may differ in size (ceil chunks) — and the
    dense model get the same count, hence the same partition."""
    declared: dict[int, tuple[int, ...]] = {}
    for sub in module.modules():
        if isinstance(sub, SpecProvider):
            for attr, spec in sub.tensor_parallel_specs().items():
                declared[id(sub.get_parameter(attr))] = spec.global_shape
    return sum(
        math.prod(declared[id(p)]) if id(p) in declared else p.numel() for p in module.parameters() if p.requires_grad
    )
