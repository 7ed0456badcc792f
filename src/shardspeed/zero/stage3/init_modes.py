"""The two torch modes active during a ``zero.Init`` block; they feed ``init_record.Recording``.

``RecordOps`` (a ``TorchDispatchMode``) records every aten op touching a meta tensor ([Note: init recording]).
``RecordDataFactories`` (a ``TorchFunctionMode``) records what no aten op shows: ``torch.tensor(data)`` constants,
torch.nn.init's meta shortcuts ([Note: meta shortcuts]), and raises when a meta tensor's value would flow into
Python. Both are entered and left by ``zero.Init`` (init.py); nothing in torch is patched.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardspeed.zero.stage3.init_record import Recording, UnreplayableInitError, _building_where

aten = torch.ops.aten

# Tensor methods through which a meta tensor's value would flow into Python
_TO_PYTHON = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__array__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}
_FROM_DATA: dict[Callable[..., Any], int] = {  # factories from Python data → index of the data argument
    torch.tensor: 0,
    torch.as_tensor: 0,
    torch.asarray: 0,
    torch.Tensor.new_tensor: 1,
}


def _meta_shortcut_functions() -> dict[Any, Callable[..., Any]]:
    """Code objects in ``torch.nn.init`` that read ``is_meta`` (the shortcuts) → the public function to replay.
    ``_no_grad_trunc_normal_`` is replayed as ``trunc_normal_`` (same parameters)."""
    init = torch.nn.init
    out: dict[Any, Callable[..., Any]] = {}
    for name, function in vars(init).items():
        code = getattr(function, "__code__", None)
        if code is None or "is_meta" not in code.co_names:
            continue
        public = getattr(init, name.removeprefix("_no_grad_"), function)
        if public is not function and list(inspect.signature(public).parameters) != list(
            inspect.signature(function).parameters
        ):
            public = function
        out[code] = public
    return out


_META_SHORTCUTS = _meta_shortcut_functions()
_IS_META = torch._C.TensorBase.is_meta  # the property's descriptor: its __get__ reaches __torch_function__


class RecordOps(TorchDispatchMode):
    """Records every aten op touching a meta tensor into ``recording``; see [Note: init recording]."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            raise _to_python_error("its value was read into Python (.item() or equivalent)")
        flat, spec = tree_flatten((args, kwargs))
        touches_meta = any(
            (isinstance(v, torch.Tensor) and v.is_meta) or (isinstance(v, torch.device) and v.type == "meta")
            for v in flat
        )
        if not touches_meta:
            return func(*args, **kwargs)
        return self.recording.record(func, args, kwargs, flat, spec, lambda: func(*args, **kwargs))


class RecordDataFactories(TorchFunctionMode):
    """``torch.tensor(data)`` and friends under the meta device, whose data the dispatch mode never sees; and the
    Tensor methods that would move a meta tensor's value into Python (an error naming the module)."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording
        self._last_shortcut_frame: Any = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _IS_META:
            is_meta = func(*args, **kwargs)
            if is_meta:
                self._watch_meta_shortcut(sys._getframe(1))
            return is_meta
        if func in _TO_PYTHON and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            raise _to_python_error(f"its value was read into Python ({getattr(func, '__name__', func)})")
        out = func(*args, **kwargs)
        position = _FROM_DATA.get(func)
        if position is not None and isinstance(out, torch.Tensor) and out.is_meta and not self.recording.known(out):
            data = args[position] if len(args) > position else kwargs.get("data")
            if data is not None and not (isinstance(data, torch.Tensor) and data.is_meta):
                self.recording.add_constant(out, torch.as_tensor(data, dtype=out.dtype, device="cpu"))
        return out

    def _watch_meta_shortcut(self, frame: Any) -> None:
        """[Note: meta shortcuts]: ``tensor.is_meta`` read by one of torch.nn.init's shortcut functions."""
        function = _META_SHORTCUTS.get(frame.f_code)
        if function is not None and self._last_shortcut_frame is not frame:
            self._last_shortcut_frame = frame  # a function reading is_meta twice is one call
            self.recording.record_function(function, dict(frame.f_locals))


def _to_python_error(what: str) -> UnreplayableInitError:
    return UnreplayableInitError(
        f"zero.Init: a meta tensor was used as data {_building_where()}: {what}. Under zero.Init tensors have no "
        "values until stage 3 materializes them, so a value computed from one in Python cannot be replayed. Compute "
        "it from the module's arguments (or on the CPU with device='cpu'), or build this module outside zero.Init"
    )
