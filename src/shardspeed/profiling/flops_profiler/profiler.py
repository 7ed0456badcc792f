"""DeepSpeed's standalone flops-profiler API (``deepspeed.profiling.flops_profiler``): ``FlopsProfiler`` and
``get_model_profile``, on shardspeed's counting (``session.py``: torch's ``FlopCounterMode``, no patching of
``torch.nn.functional``).

As in DeepSpeed, the totals are those of the model's *forward* pass(es) inside the window: a root-module hook marks
each call of the model as a forward phase; work outside it (a ``loss.backward()`` in the window) is counted by the
mode but charged to no phase here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardspeed.profiling.session import ProfileSession, WindowFigures
from shardspeed.profiling.summary import render_profile
from shardspeed.profiling.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

logger = logging.getLogger(__name__)


def _device_of(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class FlopsProfiler:
    """Profile ``model`` between ``start_profile()`` and ``stop_profile()`` / ``end_profile()``.

    ``ds_engine`` and ``recompute_fwd_factor`` are accepted for DeepSpeed's signature; the engine's own profiler is
    ``engine.flops_profiler`` (profiling/engine_profiler.py).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._session: ProfileSession | None = None
        self._root_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._depth = 0

    # --- DeepSpeed's methods -----------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting; each call of the model from now on is a profiled forward."""
        self.end_profile()
        self._session = ProfileSession(self.model, _device_of(self.model), ignore=tuple(ignore_list or ()))
        self._session.start()
        self._root_hooks = [
            self.model.register_forward_pre_hook(self._enter_forward),
            self.model.register_forward_hook(self._leave_forward),
        ]
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the figures stay readable until ``end_profile``."""
        for handle in self._root_hooks:
            handle.remove()
        self._root_hooks.clear()
        if self._session is not None:
            self._session.stop()

    def reset_profile(self) -> None:
        """Zero the figures and keep profiling (DeepSpeed's semantics)."""
        if self.started:
            self.start_profile()

    def end_profile(self) -> None:
        """Stop and forget the figures."""
        self.stop_profile()
        self._session = None
        self.started = False

    def get_total_flops(self, as_string: bool = False) -> int | str:
        flops = self._figures().flops("forward") if self._session is not None else 0
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._figures().flops("forward") // 2 if self._session is not None else 0
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        seconds = self._figures().seconds("forward") if self._session is not None else 0.0
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self._figures().params if self._session is not None else 0
        return params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """DeepSpeed's printout: to ``output_file`` when given (DeepSpeed's behaviour), else to stdout."""
        if not self.started or self._session is None:
            return
        text = "\n".join(render_profile(self._figures(), profile_step, module_depth, top_modules, detailed))
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        else:
            print(text)

    # --- internals ---------------------------------------------------------------------------------------------
    def _figures(self) -> WindowFigures:
        assert self._session is not None
        return self._session.figures()

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1 and self._session is not None:
            self._session.begin_phase("forward")

    def _leave_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._session is not None:
            self._session.end_phase("forward")


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = [],
    kwargs: dict[str, Any] = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """(flops, macs, params) of one ``model`` forward (or ``generate``) on ``input_shape`` or ``args``/``kwargs``,
    after ``warm_up`` unprofiled calls; strings when ``as_string``. DeepSpeed's function, same parameters."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else torch.get_default_dtype()
        args = [torch.ones(input_shape, dtype=dtype, device=_device_of(model))]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model's call")
    model.eval()
    call = model if mode == "forward" else model.generate  # type: ignore[operator]
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    call(*args, **kwargs)
    prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
