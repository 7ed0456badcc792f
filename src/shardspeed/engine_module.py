"""The engine as an ``nn.Module`` (DeepSpeedEngine is one): the wrapped model is the registered submodule
``module``, so ``engine.parameters()``, ``named_parameters()`` (names prefixed ``module.``), ``modules()``,
``train()``/``eval()``, forward hooks and ``engine(x)`` through ``nn.Module.__call__`` behave as they do on
DeepSpeed's engine.

[Note: engine as nn.Module] What nn.Module would get wrong for a sharded engine is overridden here:
- ``state_dict()``: stages 0-2 hold whole parameters and use nn.Module's (keys ``module.<name>``, as DeepSpeed).
  Under ZeRO-3 parameters are empty placeholders between uses, which DeepSpeed's engine returns as they are; here
  the state dict is gathered unit by unit instead (collective: every rank calls it), and ``keep_vars=True``, which
  would hand out placeholders, is refused. Under tensor parallelism each partitioned tensor is also assembled over
  the tensor axis, so the state dict is the dense model's ([Note: full weights under tensor parallelism]);
  ``keep_vars=True`` is refused there too (the parameters are slices).
- ``load_state_dict()``: writes through the stage (param_access.py): fp32 masters, shards, optimizer-held values,
  then the model's parameters; never into a placeholder. It takes the dense state dict ``state_dict()`` gives:
  under tensor parallelism each rank keeps its ``ParamSpec.slice_global``. Key/shape problems are agreed across
  ranks first, so a bad state dict is the same error everywhere instead of a hang in the propagation's all-gather.
- ``_apply`` (``to()``, ``cuda()``, ``half()``, ``float()``…): after initialize the stage's buffers, masters and
  optimizer tensors are bound to the parameters' device and dtype, so a real move or cast is refused with the tensor
  it would have changed; a no-op (same device and dtype, as DeepSpeed scripts often do) is allowed.
- ``__getattr__``: attributes the engine does not have fall through to the wrapped model, as in DeepSpeed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

from shardspeed.checkpoint.pipe_stages import add_other_stages, names_held_anywhere
from shardspeed.faults.errors import mark_agreed
from shardspeed.faults.guard import guarded
from shardspeed.param_access import canonical_names, full_shapes, write_values
from shardspeed.tensor_parallel.full_weights import global_shapes, globalize, local_values, tensor_split

PREFIX = "module."


class EngineModule(torch.nn.Module):
    """nn.Module behaviour of ``ShardSpeedEngine`` (see [Note: engine as nn.Module])."""

    module: torch.nn.Module
    config: Any
    states: Any
    topology: Any
    collectives: Any

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:  # DeepSpeed passes attributes it does not define through to the wrapped model
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(
                    f"'{type(self).__name__}' object has no attribute '{name}' (nor has the wrapped "
                    f"{type(module).__name__})"
                ) from None

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """nn.Module's (``parameters()`` calls it), once pending post-step parameter gathers have landed ([Note:
        overlapped parameter gather] in zero/param_gather.py): the values handed out are the updated ones."""
        states = self.__dict__.get("states")  # absent while the engine is being built
        if states is not None:
            states.wait_params()
        return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    # --- state dict -----------------------------------------------------------------------------------------------
    def _partitioned(self) -> bool:
        """Whether the module's own state dict is not the dense model's: ZeRO-3 placeholders, tensor slices, or one
        pipeline stage's layers."""
        return self.config.zero_optimization.stage == 3 or tensor_split(self) or self.topology.pipe.size > 1

    @guarded("engine.state_dict()")
    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """nn.Module's state dict (keys ``module.<name>``). ZeRO-3: gathered unit by unit, every rank must call it."""
        self.states.wait_params()  # [Note: overlapped parameter gather] in zero/param_gather.py
        if not self._partitioned():
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if args:
            raise mark_agreed(TypeError("engine.state_dict(): pass destination, prefix and keep_vars by keyword"))
        if keep_vars:
            raise mark_agreed(
                ValueError(
                    "engine.state_dict(keep_vars=True) under ZeRO-3 or tensor parallelism: the parameters are empty "
                    "placeholders or tensor slices; call it without keep_vars for the full values, or use "
                    "shardspeed.zero.GatheredParameters"
                )
            )
        out = destination if destination is not None else OrderedDict()
        for name, value in self.module_state_dict().items():
            out[prefix + PREFIX + name] = value
        return out

    @guarded("engine.module_state_dict()")
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, torch.Tensor]:
        """DeepSpeed's module_state_dict: the model's full state dict (no ``module.`` prefix), as the dense model
        holds it. Under ZeRO-3 parameters are gathered unit by unit and under tensor parallelism each partitioned
        tensor is assembled over the tensor axis ([Note: full weights under tensor parallelism]); with a pipe axis
        each stage's is completed with the other stages' ([Note: checkpoints across pipeline degrees]): every rank
        must call this."""
        self.states.wait_params()  # [Note: overlapped parameter gather] in zero/param_gather.py
        full_state_dict = getattr(self.states, "full_state_dict", None)
        split, piped = tensor_split(self), self.topology.pipe.size > 1
        if full_state_dict is None and not split and not piped:
            out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            if exclude_frozen_parameters:
                for name in _frozen_names(self.module):
                    out.pop(prefix + name, None)
            return out
        if keep_vars:
            raise mark_agreed(
                ValueError(
                    "module_state_dict(keep_vars=True) under ZeRO-3, tensor or pipeline parallelism: parameters are "
                    "placeholders, tensor slices or on other stages; call it without keep_vars for the full values"
                )
            )
        state = full_state_dict(self.module) if full_state_dict is not None else self.module.state_dict()
        if exclude_frozen_parameters:  # before gathering: frozen-ness is the same on every tensor rank
            for name in _frozen_names(self.module):
                state.pop(name, None)
        out = destination if destination is not None else OrderedDict()
        for name, value in globalize(self, state) if split else state.items():
            out[prefix + name] = value
        return add_other_stages(self, out) if piped else out

    @guarded("engine.load_state_dict()")
    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """nn.Module's load_state_dict for the engine (keys ``module.<name>``), written through the stage into
        masters, shards and optimizer-held values. Every rank must call it with the same state dict: the dense
        model's (under tensor parallelism each rank keeps its slices)."""
        if assign:
            raise mark_agreed(
                ValueError(
                    "engine.load_state_dict(assign=True): the engine owns its parameters' storage (flat buffers, "
                    "shards); load values with assign=False"
                )
            )
        inner = {k[len(PREFIX) :]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
        outside = [k for k in state_dict if not k.startswith(PREFIX)]
        missing, unexpected = load_module_values(self, inner, strict, extra_unexpected=outside, key_prefix=PREFIX)
        return _IncompatibleKeys(missing, unexpected)

    # --- device and dtype -----------------------------------------------------------------------------------------
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> EngineModule:
        """Allow only no-op moves/casts (see [Note: engine as nn.Module])."""
        for kind, named in (("parameter", self.named_parameters()), ("buffer", self.named_buffers())):
            for name, tensor in named:
                moved = fn(tensor)
                if moved is tensor or (
                    moved.dtype == tensor.dtype
                    and moved.device == tensor.device
                    and moved.data_ptr() == tensor.data_ptr()
                ):
                    continue
                raise RuntimeError(
                    f"cannot move or cast the engine after initialize(): {kind} '{name}' would go from "
                    f"{tensor.dtype} on {tensor.device} to {moved.dtype} on {moved.device}. The ZeRO stage's "
                    "buffers, fp32 masters and optimizer states are bound to the training device and dtype: move or "
                    "cast the model before initialize() (precision comes from the config's bf16/fp16 sections)"
                )
        return self


def load_module_values(
    engine: Any,
    state_dict: Mapping[str, Any],
    strict: bool,
    *,
    extra_unexpected: list[str] | None = None,
    key_prefix: str = "",
) -> tuple[list[str], list[str]]:
    """Load a module state dict (the model's own names, dense shapes) into the engine at any stage. Returns
    (missing, unexpected) keys with ``key_prefix``. Problems are agreed across all ranks before anything is written,
    so every rank raises the same error (or none does and all enter the propagation's collectives). Under tensor
    parallelism partitioned tensors are checked against their global shapes and each rank keeps its slices."""
    module = engine.module
    shapes = global_shapes(engine, full_shapes(module))
    missing = sorted(set(shapes) - set(state_dict))
    # with a pipe axis a name another stage holds is not unexpected (collective: every rank is here)
    anywhere = names_held_anywhere(engine, set(shapes)) or set(shapes)
    unexpected = sorted(set(state_dict) - anywhere)
    problems = [
        f"size mismatch for {key_prefix}{name}: copying a tensor of shape {tuple(value.shape)}, the shape in the "
        f"model is {tuple(shapes[name])}"
        for name, value in state_dict.items()
        if name in shapes and tuple(getattr(value, "shape", ())) != tuple(shapes[name])
    ]
    unexpected_all = [key_prefix + k for k in unexpected] + list(extra_unexpected or [])
    missing_all = [key_prefix + k for k in missing]
    if strict and (missing_all or unexpected_all):
        problems.insert(0, f"missing keys {missing_all[:10]}, unexpected keys {unexpected_all[:10]}")
    error = "; ".join(problems) if problems else None
    # over the world: tensor ranks write different slices but must agree to write at all
    everyone = engine.collectives.all_gather_object((error, sorted(state_dict)), engine.topology.world)
    for rank, (other_error, keys) in enumerate(everyone):
        if other_error is not None:
            where = f"{type(module).__name__} (rank {rank})"
            raise mark_agreed(RuntimeError(f"Error(s) in loading state_dict for {where}: {other_error}"))
        if keys != everyone[0][1]:
            raise mark_agreed(
                RuntimeError(
                    "load_state_dict: ranks were given state dicts with different keys; every rank "
                    "must load the same state dict"
                )
            )
    canonical = canonical_names(module)
    state_dict = local_values(engine, {n: v for n, v in state_dict.items() if n in shapes})
    values: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if name in state_dict:
            values.setdefault(canonical[id(p)], state_dict[name])
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name in state_dict:
                buf.copy_(state_dict[name])
        write_values(engine, values)
    return missing_all, unexpected_all


def _frozen_names(module: torch.nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def apply_custom_load(engine: Any, src: dict[str, torch.Tensor], custom_load_fn: Callable[..., Any]) -> None:
    """DeepSpeed's ``load_checkpoint(custom_load_fn=...)``: ``custom_load_fn(src=module_state_dict, dst=module)``
    edits the model's parameters its own way; the edit then becomes the stage's fp32 values. Under ZeRO-3 the call
    runs on the whole gathered model and data-parallel rank 0's edit is kept (DeepSpeed: ``GatheredParameters(...,
    modifier_rank=0)``); at stages 0-2 parameters are whole already and the masters are refreshed from them."""
    module = engine.module
    if engine.config.zero_optimization.stage == 3:
        from shardspeed.zero.api import GatheredParameters

        with GatheredParameters(list(module.parameters()), modifier_rank=0):
            custom_load_fn(src=src, dst=module)
        return
    custom_load_fn(src=src, dst=module)
    values = {name: p.detach() for name, p in module.named_parameters()}
    with torch.no_grad():
        write_values(engine, values)
