"""Running one checkpointed region: forward without keeping activations, recompute them for the backward.

Two ways to hook the recompute into autograd, both sharing the input storage (``partition.py``) and the RNG
replay (``rng.py``):

Non-reentrant (the default) is torch's ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the forward
runs under saved-tensor hooks that record placeholders instead of activations, and the first backward node that
needs one re-runs the region and picks up the tensors it saves. It is the form torch recommends: the backward
stays one autograd pass (no nested ``backward`` call), so gradient hooks, ZeRO's reduce hooks and
``retain_graph`` behave as without checkpointing, and parameters need no input that requires grad to receive
gradients. What torch does not let us choose is where the *inputs* live: it keeps the argument tensors itself.
So the region is handed to torch as a zero-argument closure over an ``_Inputs`` holder: during the forward the
holder has the caller's objects; as soon as the forward returns it swaps them for their stored form (host copy,
partition) and the closure rebuilds them for the recompute. Gradients still reach the original inputs because
the forward ran on them — the recompute only supplies the saved tensors, never new graph edges. Torch's own RNG
stashing is switched off (``preserve_rng_state=False``) and replaced, through ``context_fn``, by ``RngSnapshot``,
which also replays the tensor-parallel tracker states torch knows nothing about.

Reentrant (``use_reentrant=True``, DeepSpeed's ``CheckpointFunction``): an autograd Function that runs the region
under ``no_grad`` and, in its backward, recomputes it with grad enabled and calls ``torch.autograd.backward`` on
the recomputed outputs. Kept for code that relies on DeepSpeed's classic behaviour. A zero-size "anchor" tensor
that requires grad is always passed in, so regions whose inputs need no gradient still pass gradients to the
parameters they use (a classic pitfall of reentrant checkpointing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardspeed.comm.collectives import Collectives
from shardspeed.topology import AxisGroup

from .partition import InputStore, StoragePlan
from .rng import RngSnapshot, RNGStatesTracker


@dataclass
class ProfileStats:
    """Totals kept when the ``profile`` option is on (DeepSpeed prints similar timers)."""

    forward_calls: int = 0
    forward_seconds: float = 0.0
    recompute_calls: int = 0
    recompute_seconds: float = 0.0
    stored_bytes: int = 0
    """Bytes of stored inputs, summed over every checkpointed forward so far."""

    def summary(self) -> str:
        return (
            f"activation checkpointing: {self.forward_calls} forwards in {self.forward_seconds:.4f}s, "
            f"{self.recompute_calls} recomputes in {self.recompute_seconds:.4f}s, "
            f"{self.stored_bytes / 2**20:.2f} MiB of inputs stored"
        )


@dataclass
class RegionSettings:
    """Everything one checkpointed region needs besides the function and its arguments."""

    plan: StoragePlan
    axis: AxisGroup
    collectives: Collectives
    tracker: RNGStatesTracker
    synchronize: bool = False
    stats: ProfileStats | None = None


def _synchronize(settings: RegionSettings) -> None:
    if settings.synchronize and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _tensor_devices(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterator[torch.device]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value.device


class _Inputs:
    """The region's arguments: the caller's own objects until the forward ends, then their stored form."""

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self.live: tuple[tuple[Any, ...], Mapping[str, Any]] | None = (args, kwargs)
        self.store: InputStore | None = None

    def current(self, settings: RegionSettings) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
        if self.live is not None:
            return self.live
        if self.store is None:
            raise RuntimeError("activation checkpointing: the region's inputs were released before the recompute")
        return self.store.rebuild(settings.collectives, settings.axis)

    def stash(self, settings: RegionSettings) -> None:
        """Replace the caller's objects by their stored form, dropping our references to the originals."""
        if self.live is None:
            return
        self.store = InputStore(*self.live, settings.plan, settings.axis)
        self.live = None
        if settings.stats is not None:
            settings.stats.stored_bytes += self.store.nbytes


class RecomputeObserver:
    """Told when a recompute starts and ends (the flops profiler measures recompute FLOPs between the two: exact
    for any region, a module call or not). Register with ``add_recompute_observer``; calls nest."""

    def recompute_started(self) -> None: ...

    def recompute_ended(self) -> None: ...


_OBSERVERS: list[RecomputeObserver] = []


def add_recompute_observer(observer: RecomputeObserver) -> None:
    _OBSERVERS.append(observer)


def remove_recompute_observer(observer: RecomputeObserver) -> None:
    if observer in _OBSERVERS:
        _OBSERVERS.remove(observer)


class _RecomputeScope:
    """Entered around every recompute: replays the forward's RNG states, synchronizes and times if asked.

    A class rather than a ``@contextmanager`` because torch enters the same object once per recompute, and a
    region is recomputed again for every backward through a retained graph.
    """

    def __init__(self, snapshot: RngSnapshot, settings: RegionSettings) -> None:
        self._snapshot = snapshot
        self._settings = settings
        self._active: list[tuple[Any, float]] = []

    def __enter__(self) -> None:
        _synchronize(self._settings)
        replay = self._snapshot.restored()
        replay.__enter__()
        self._active.append((replay, time.perf_counter()))
        for observer in tuple(_OBSERVERS):
            observer.recompute_started()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> bool | None:
        for observer in tuple(_OBSERVERS):  # also when torch stops the recompute early by raising: what ran
            observer.recompute_ended()
        replay, started = self._active.pop()
        _synchronize(self._settings)
        stats = self._settings.stats
        if stats is not None:
            stats.recompute_calls += 1
            stats.recompute_seconds += time.perf_counter() - started
        return replay.__exit__(kind, error, trace)


def _timed_forward(settings: RegionSettings, call: Callable[[], Any]) -> Any:
    _synchronize(settings)
    started = time.perf_counter()
    out = call()
    _synchronize(settings)
    if settings.stats is not None:
        settings.stats.forward_calls += 1
        settings.stats.forward_seconds += time.perf_counter() - started
    return out


def checkpoint_non_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], settings: RegionSettings
) -> Any:
    """Run ``function(*args, **kwargs)`` as a checkpointed region (torch's non-reentrant machinery)."""
    if not torch.is_grad_enabled():  # no backward will come: nothing to store, nothing to recompute
        return function(*args, **kwargs)
    snapshot = RngSnapshot.capture(settings.tracker, _tensor_devices(args, kwargs))
    inputs = _Inputs(args, kwargs)
    recompute_scope = _RecomputeScope(snapshot, settings)

    def region() -> Any:
        call_args, call_kwargs = inputs.current(settings)
        return function(*call_args, **call_kwargs)

    def contexts() -> tuple[Any, Any]:
        return _NullScope(), recompute_scope

    out = _timed_forward(
        settings,
        lambda: torch_checkpoint.checkpoint(region, use_reentrant=False, preserve_rng_state=False, context_fn=contexts),
    )
    inputs.stash(settings)
    return out


class _NullScope:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class CheckpointFunction(torch.autograd.Function):
    """The reentrant form (DeepSpeed's class name): recompute inside this Function's backward."""

    @staticmethod
    def forward(ctx: Any, region: _ReentrantRegion, anchor: torch.Tensor, *grad_inputs: torch.Tensor) -> Any:
        del anchor, grad_inputs  # present only so autograd connects the outputs to them
        with torch.no_grad():
            outputs = _timed_forward(region.settings, region.run)
        region.inputs.stash(region.settings)
        ctx.region = region
        if isinstance(outputs, torch.Tensor):
            return outputs
        if isinstance(outputs, tuple):
            return outputs
        raise TypeError(
            "reentrant activation checkpointing: the checkpointed function must return a tensor or a tuple, "
            f"got {type(outputs).__name__}; use the default non-reentrant checkpoint for other outputs"
        )

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        region: _ReentrantRegion = ctx.region
        with torch.enable_grad(), _RecomputeScope(region.snapshot, region.settings):
            call_args, call_kwargs = region.inputs.current(region.settings)
            outputs = region.function(*call_args, **call_kwargs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        rebuilt = [v for v in (*call_args, *call_kwargs.values()) if _is_grad_input(v)]
        return (None, None, *[t.grad for t in rebuilt])


def _is_grad_input(value: Any) -> bool:
    """Tensors the reentrant Function returns gradients for. Parameters are excluded: the inner backward
    already accumulates into their ``.grad``, and returning it again would count it twice."""
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.requires_grad


@dataclass
class _ReentrantRegion:
    function: Callable[..., Any]
    inputs: _Inputs
    snapshot: RngSnapshot
    settings: RegionSettings

    def run(self) -> Any:
        call_args, call_kwargs = self.inputs.current(self.settings)
        return self.function(*call_args, **call_kwargs)


def checkpoint_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], settings: RegionSettings
) -> Any:
    """Run ``function(*args, **kwargs)`` as a checkpointed region with DeepSpeed's classic reentrant backward."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    region = _ReentrantRegion(
        function, _Inputs(args, kwargs), RngSnapshot.capture(settings.tracker, _tensor_devices(args, kwargs)), settings
    )
    grad_inputs = [v for v in (*args, *kwargs.values()) if _is_grad_input(v)]
    anchor = torch.empty(0, requires_grad=True)
    return CheckpointFunction.apply(region, anchor, *grad_inputs)
