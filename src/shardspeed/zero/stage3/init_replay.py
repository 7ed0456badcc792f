"""Replay a ``zero.Init`` recording (``init_record.py``): the value of one meta tensor, computed on the CPU.

[Note: init replay] A storage's value at version ``v`` is its creation op's output followed by its first ``v``
writes, each run as the same aten overload on real tensors (meta devices in arguments become the CPU: a normal
build runs on the CPU with the CPU generator, so replay does too and the caller copies the result to the training
device). Replay starts at the last write that overwrites the whole storage without reading it (``uniform_`` of
``reset_parameters`` followed by HF's ``normal_``: only the ``normal_`` runs), because each random op carries its
own generator snapshot, so skipping dead writes changes no number. Random ops restore their snapshot first; the
caller keeps the global generator where it was (``preserved_rng``). Inputs read from other storages (``copy_``
sources, ``inv_freq``'s ``arange``) are replayed at the version the op read, memoized until ``clear()``.

A value is built straight into the caller's tensor when the parameter is its whole storage (the usual case), so
materializing a unit allocates the unit and at most one tensor-sized temporary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from shardspeed.zero.stage3.init_record import (
    Constant,
    RecordedOp,
    Recording,
    StorageHistory,
    TensorRef,
    UnreplayableInitError,
)

_CPU = torch.device("cpu")


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """The default CPU generator is left as it was found (replay sets it to recorded snapshots)."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


class _Building:
    """A storage being replayed into: an untyped storage and the byte offset where the recorded storage starts."""

    def __init__(self, storage: torch.UntypedStorage, byte_offset: int) -> None:
        self.storage, self.byte_offset = storage, byte_offset

    def view(self, ref: TensorRef) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=ref.dtype).element_size()
        return torch.empty(0, dtype=ref.dtype).set_(
            self.storage, self.byte_offset // itemsize + ref.offset, ref.size, ref.stride
        )


class Replayer:
    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._storages: dict[tuple[int, int], _Building] = {}
        self._outputs: dict[int, list[Any]] = {}  # id(op) → its flat outputs

    def clear(self) -> None:
        self._storages.clear()
        self._outputs.clear()

    def maybe_uninitialized(self, ref: TensorRef) -> bool:
        """Whether the value may still hold unwritten elements (created by ``empty``, never wholly overwritten)."""
        history = self.recording.histories[ref.storage]
        return history.uninitialized and not any(w.overwrites_all for w in history.writes[: ref.version])

    def never_written(self, ref: TensorRef) -> bool:
        history = self.recording.histories[ref.storage]
        return history.uninitialized and ref.version == 0

    def value(self, ref: TensorRef) -> torch.Tensor:
        return self._storage(ref.storage, ref.version).view(ref)

    def fill(self, ref: TensorRef, out: torch.Tensor) -> None:
        """Write the value of ``ref`` into ``out`` (same shape; dtype cast if it differs)."""
        history = self.recording.histories[ref.storage]
        whole = (
            out.device == _CPU
            and out.dtype == ref.dtype
            and out.is_contiguous()
            and ref.offset == 0
            and ref.numel * out.element_size() == history.nbytes
        )
        if whole:  # build the storage directly in out (no temporary)
            target = _Building(out.untyped_storage(), out.storage_offset() * out.element_size())
            self._build(ref.storage, ref.version, target)
            return
        with torch.no_grad():
            out.copy_(self.value(ref))

    # --- storages ------------------------------------------------------------------------------------------
    def _storage(self, index: int, version: int) -> _Building:
        key = (index, version)
        found = self._storages.get(key)
        if found is None:
            history = self.recording.histories[index]
            found = _Building(torch.UntypedStorage(history.nbytes), 0)
            self._build(index, version, found)
            self._storages[key] = found
        return found

    @torch.no_grad()
    def _build(self, index: int, version: int, into: _Building) -> None:
        history = self.recording.histories[index]
        writes = history.writes[:version]
        start = max((i for i, w in enumerate(writes) if w.overwrites_all), default=None)
        if start is None:
            self._create(history, into)
            start = 0
        for position in range(start, version):
            write = history.writes[position]
            self._run(write.op, building=(index, position, into))

    def _create(self, history: StorageHistory, into: _Building) -> None:
        if history.creation is None:
            raise UnreplayableInitError(
                "its value comes from a meta tensor created outside the zero.Init block (nothing recorded how it "
                "was computed)"
            )
        op, position = history.creation
        if history.uninitialized:  # empty(): no values; NaN makes an unwritten float element detectable
            flat = torch.empty(0, dtype=torch.uint8).set_(into.storage, into.byte_offset, (history.nbytes,), (1,))
            flat.fill_(255)  # 0xFF… is a NaN in every float dtype
            return
        outputs = self._outputs.get(id(op))
        if outputs is None:
            outputs = self._outputs[id(op)] = tree_flatten(self._run(op, building=None))[0]
        result = outputs[position]
        source = result.untyped_storage()
        dest = torch.empty(0, dtype=torch.uint8).set_(into.storage, into.byte_offset, (history.nbytes,), (1,))
        dest.copy_(torch.empty(0, dtype=torch.uint8).set_(source, 0, (history.nbytes,), (1,)))

    def _run(self, op: RecordedOp, building: tuple[int, int, _Building] | None) -> Any:
        def resolve(value: Any) -> Any:
            if isinstance(value, Constant):
                return value.value
            if isinstance(value, torch.device) and value.type == "meta":
                return _CPU
            if isinstance(value, TensorRef):
                if building is not None and value.storage == building[0] and value.version == building[1]:
                    return building[2].view(value)  # the storage being built, as this write sees it
                return self.value(value)
            return value

        args, kwargs = tree_map(resolve, op.args), tree_map(resolve, op.kwargs)
        if op.rng_state is not None:
            torch.set_rng_state(op.rng_state)
        if op.generator_state is not None:
            generator = torch.Generator()
            generator.set_state(op.generator_state)
            kwargs["generator"] = generator
        return op.func(*args, **kwargs)
