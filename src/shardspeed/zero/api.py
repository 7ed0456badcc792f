"""The public ``shardspeed.zero`` names for ZeRO-3 models (DeepSpeed's ``deepspeed.zero`` API).

``Init`` builds a model on the meta device for stage 3 to materialize unit by unit; ``GatheredParameters`` makes
partitioned parameters whole inside a block; ``full_shape`` / ``full_numel`` give a partitioned parameter's real
size (outside a gathered block it is an empty placeholder with ``numel() == 0``); ``register_external_parameter``
declares that a module's forward uses a parameter another module owns; ``apply`` is ``module.apply(fn)`` for a
partitioned model (DeepSpeed's ``override_module_apply``). See docs/zero3.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardspeed.zero.stage3.gathered import GatheredParameters
from shardspeed.zero.stage3.init import Init
from shardspeed.zero.stage3.registry import add_external_parameter, partitioned

__all__ = ["GatheredParameters", "Init", "apply", "full_numel", "full_shape", "register_external_parameter"]


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape ``param`` has when whole: its unit's record for a ZeRO-3 partitioned parameter, else its own."""
    record = partitioned(param)
    return record.full_shape if record is not None else param.shape


def full_numel(param: torch.Tensor) -> int:
    """The number of elements ``param`` has when whole (see ``full_shape``)."""
    return math.prod(full_shape(param))


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather ``parameter`` around ``module``'s forward and backward although another module owns it.

    For a forward that reads another module's weight directly (``x @ self.embed.weight.T``): under ZeRO-3 that
    weight is only gathered around its own module's forward. Call this before ``shardspeed.initialize`` (usually
    in ``module.__init__``, also under ``zero.Init``); the engine reads the registrations when it attaches its hooks.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(
            f"register_external_parameter: parameter must be an nn.Parameter, got {type(parameter).__name__}"
        )
    record = partitioned(parameter)
    if record is not None and not (record.unit is not None and record.unit.persistent):
        raise RuntimeError(
            f"register_external_parameter({type(module).__name__}, parameter of shape {tuple(record.full_shape)}) "
            "called after shardspeed.initialize(): the engine attaches its gather hooks once, at initialize(). "
            "Register it before, e.g. in the module's __init__"
        )
    add_external_parameter(module, parameter)


def apply(module: torch.nn.Module, fn: Callable[[torch.nn.Module], None], modifier_rank: int = 0) -> torch.nn.Module:
    """``module.apply(fn)`` for a ZeRO-3 model: ``fn`` sees each module's own parameters whole and its writes are
    kept (rank ``modifier_rank``'s result, on every rank). Collective: every data-parallel rank must call it.

    What DeepSpeed's ``override_module_apply: true`` does behind ``nn.Module.apply``. shardspeed patches neither
    torch nor modules, so call this instead; a plain ``module.apply(fn)`` that writes partitioned parameters
    after ``initialize`` is an error at the next forward (zero/stage3/apply_guard.py). Same order as
    ``nn.Module.apply`` (children before their parent); parameters no ZeRO-3 engine partitions are used as they
    are, so on other stages (or before ``initialize``) this is ``module.apply(fn)``.
    """
    for child in module.children():
        apply(child, fn, modifier_rank)
    with GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=modifier_rank):
        fn(module)
    return module
