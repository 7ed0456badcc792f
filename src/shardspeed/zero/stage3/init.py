"""``zero.Init``: build a model for ZeRO-3 without any rank ever holding it whole.

Inside the context every tensor factory defaults to the meta device (``torch.device("meta")`` used as a context
manager — torch's own mechanism; no torch function or ``nn.Module.__init__`` is patched), so constructing the model
allocates nothing. Meanwhile a dispatch mode records how every meta tensor's value is computed (factories,
in-place initialization, HF's ``post_init``: [Note: init recording] in ``init_record.py``); at exit each module's
parameters and buffers are bound to their recorded values (``RECORDED``). ``shardspeed.initialize`` with stage 3
then materializes the model one unit at a time (``materialize.py``): allocate the unit, replay its recorded values
(or, for a tensor with no recording, run ``reset_parameters()``), run ``init_fn``, broadcast from rank 0, keep this
rank's shard, free the unit, next.

How ``init_fn`` (and the rest of what Init knows) reaches the engine — [Note: creation records]. Init cannot know
which object is "the model": a user may build several models inside one context, build submodules inside it and
attach them to a root built outside, or nest contexts. What flows into ``initialize()`` is the parameters. So
while the context is active, torch's global parameter/buffer registration hooks
(``register_module_parameter_registration_hook``, a public torch API) record for every meta tensor registered on a
module a ``CreationRecord``: the module that registered it first (its *creator*: its ``reset_parameters`` is the
one that really initializes it — a later registration is a tie such as ``head.weight = emb.weight``), its dtype
at creation (before the engine casts to bf16, so initialization is bitwise the fp32 one), and the context's
settings (``init_fn``). Records live in a weak identity map (``registry.WeakIdMap``): no attribute on the
parameter, nothing kept alive, and no distributed state at module level.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from shardspeed.config.load import ConfigSource, read_config_source
from shardspeed.zero.stage3.init_modes import RecordDataFactories, RecordOps
from shardspeed.zero.stage3.init_record import Recording, TensorRef
from shardspeed.zero.stage3.registry import WeakIdMap

InitFn = Callable[[torch.nn.Module], None]


@dataclass(frozen=True)
class InitSettings:
    """What one ``zero.Init`` context asks of materialization."""

    init_fn: InitFn | None = None


@dataclass(frozen=True)
class CreationRecord:
    creator_ref: weakref.ref[torch.nn.Module]
    name: str  # attribute name on the creator
    dtype: torch.dtype  # dtype at creation
    settings: InitSettings

    @property
    def creator(self) -> torch.nn.Module | None:
        return self.creator_ref()


CREATED: WeakIdMap[CreationRecord] = WeakIdMap()
"""Meta parameter or buffer → how it was created under ``zero.Init`` (see [Note: creation records])."""


def creation_record(tensor: torch.Tensor) -> CreationRecord | None:
    return CREATED.get(tensor)


@dataclass(frozen=True)
class RecordedValue:
    """A module's parameter or buffer as it stood at the end of the ``zero.Init`` block: its recorded value."""

    recording: Recording
    ref: TensorRef
    alias: torch.Tensor  # a meta alias sharing the tensor's version counter: detects writes after the block
    version: int  # alias._version at the end of the block

    @property
    def dtype(self) -> torch.dtype:
        return self.ref.dtype

    def written_after_block(self) -> bool:
        return self.alias._version != self.version

    @property
    def recorded(self) -> bool:
        """Whether anything was recorded for it (a meta tensor made outside any block and untouched inside was not:
        materialization falls back to reset_parameters / init_fn for it)."""
        history = self.recording.histories[self.ref.storage]
        return history.creation is not None or bool(history.writes)


RECORDED: WeakIdMap[dict[str, RecordedValue]] = WeakIdMap()
"""Module built under ``zero.Init`` → attribute → recorded value, bound when the block exits (keyed by module and
name, not by tensor: the engine's cast to bf16 replaces meta buffers before materialization)."""


def recorded_value(module: torch.nn.Module, attr: str) -> RecordedValue | None:
    values = RECORDED.get(module)
    return values.get(attr) if values is not None else None


_ACTIVE: list[Recording] = []
"""The recording of the outermost active zero.Init block: a nested block records into it (two dispatch modes
would each advance the generator for the same random op). Process-local, not distributed state."""


class Init:
    """Context manager: modules constructed inside live on the meta device until stage 3 materializes them.

    Every value computed in the block is recorded and replayed at materialization ([Note: init recording]):
    ``with zero.Init(): model = AutoModelForCausalLM.from_config(cfg)`` gives weights and buffers bitwise equal to
    a normal build (then cast to the training dtype), with no ``init_fn``; the random generator ends where a
    normal build leaves it. What cannot be replayed raises ``UnreplayableInitError`` naming the module or tensor.

    ``init_fn(module)``, if given, runs after that for every module that owns parameters or buffers; the result is
    bitwise equal to building the model normally and then calling ``model.apply(init_fn)`` with the same seed.

    ``config_dict_or_path`` (or ``config``, DeepSpeed's other spelling) is optional; when given, its
    ``zero_optimization.stage`` must be 3, because only stage 3 can materialize a meta model. ``enabled=False``
    makes the context a no-op (a normal build). ``mem_efficient_linear`` and ``pin_memory`` are accepted for
    DeepSpeed compatibility and have no effect; ``remote_device`` (parameter offload) is not implemented.
    """

    def __init__(
        self,
        config_dict_or_path: ConfigSource = None,
        enabled: bool = True,
        init_fn: InitFn | None = None,
        *,
        config: ConfigSource = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
    ) -> None:
        if config_dict_or_path is not None and config is not None:
            raise ValueError("zero.Init: pass the config as config_dict_or_path or as config, not both")
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"zero.Init: init_fn must be callable(module), got {type(init_fn).__name__}")
        if remote_device not in (None, "none"):
            raise NotImplementedError(
                f"zero.Init: remote_device={remote_device!r} (parameter offload) is not implemented; "
                "use None to keep parameter shards on the training device"
            )
        _check_stage(config_dict_or_path if config is None else config)
        self.enabled = bool(enabled)
        self.settings = InitSettings(init_fn=init_fn)
        self._device_context: Any = None
        self._handles: list[Any] = []
        self._modes: list[Any] = []
        self._recording: Recording | None = None
        self._seen: dict[int, weakref.ref[torch.nn.Module]] = {}  # modules that registered meta tensors

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if self._device_context is not None:
            raise RuntimeError("zero.Init: this context is already active; create a new Init() to nest")
        self._device_context = torch.device("meta")
        self._device_context.__enter__()
        self._handles = [
            register_module_parameter_registration_hook(self._on_register),
            register_module_buffer_registration_hook(self._on_register),
        ]
        self._seen = {}
        if _ACTIVE:  # nested: the outer block's modes already record everything
            self._recording, self._modes = _ACTIVE[-1], []
        else:
            self._recording = Recording()
            self._modes = [
                RecordDataFactories(self._recording),
                RecordOps(self._recording),
            ]
            for mode in self._modes:
                mode.__enter__()
        _ACTIVE.append(self._recording)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled or self._device_context is None:
            return
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []
        _ACTIVE.pop()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        context, self._device_context = self._device_context, None
        context.__exit__(None, None, None)
        recording, self._recording = self._recording, None
        if not _ACTIVE and recording is not None:
            recording.scratch.release()  # the outermost block is done: nothing random is drawn for it any more
        if exc[0] is None and recording is not None:
            self._bind_recorded_values(recording)
        self._seen = {}

    def _bind_recorded_values(self, recording: Recording) -> None:
        """Every module that registered a meta tensor: its current parameters and buffers → their recorded value."""
        for ref in self._seen.values():
            module = ref()
            if module is None:
                continue
            values = dict(RECORDED.get(module) or {})
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None or not t.is_meta:
                    continue
                alias = t.detach()
                values[attr] = RecordedValue(recording, recording.ref(t), alias, alias._version)
            RECORDED.set(module, values)

    def _on_register(self, module: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        """A module registered a parameter or buffer: record its creator unless someone registered it first.

        Nested contexts both see the same registration; the inner one (its hook runs last) wins."""
        if tensor is None or not tensor.is_meta:
            return
        seen = self._seen.get(id(module))
        if seen is None or seen() is not module:
            self._seen[id(module)] = weakref.ref(module)
        existing = CREATED.get(tensor)
        if existing is not None and not (existing.creator is module and existing.name == name):
            return  # a later registration of a tensor created elsewhere: a tie, not a creation
        CREATED.set(tensor, CreationRecord(weakref.ref(module), name, tensor.dtype, self.settings))


def _check_stage(config: ConfigSource) -> None:
    if config is None:
        return
    zero = read_config_source(config).get("zero_optimization") or {}
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage is not None and stage != 3:
        raise ValueError(
            f"zero.Init: zero_optimization.stage is {stage!r} in the given config; zero.Init builds models on the "
            "meta device that only ZeRO stage 3 can materialize. Use stage 3, or zero.Init(enabled=False)"
        )


def has_deferred_tensors(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the meta device (built under ``zero.Init``)."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def to_device_except_deferred(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module.to(device)`` for every tensor that has data; meta tensors stay meta for stage 3 to materialize.

    (``Module.to`` on a meta tensor raises: there is nothing to copy.)"""
    return module._apply(lambda t: t if t.is_meta else t.to(device))
