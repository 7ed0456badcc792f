"""Record what defines every meta tensor built under ``zero.Init``, so materialization can replay it.

[Note: init recording] Under ``zero.Init`` tensors live on the meta device: ``torch.ones`` in ``__init__`` (HF's
``LlamaRMSNorm``), ``normal_`` on a fresh ``torch.empty`` (GPT-2's ``Conv1D``), ``inv_freq = 1 / base ** (arange /
d)`` (rotary embeddings) and HF's ``post_init() → _init_weights`` all compute nothing. A ``TorchDispatchMode``
active for the whole ``with`` block sees every aten op (after autograd and composite decomposition: ``nn.init.*``
arrive as ``uniform_``, ``normal_``, ``fill_``…; the few that skip meta tensors: [Note: meta shortcuts]) and
records, per meta *storage*, a small graph: the op that created it (factory or out-of-place op on other recorded
storages) and the ordered in-place ops that wrote it (``normal_``, ``fill_``, ``copy_`` from another recorded
tensor, …). Storages, not tensors: ``p.data``, ``weight[idx]`` and ``nn.Parameter(t)`` are aliases of one storage,
so an op through any of them lands in the same history. A tensor argument is recorded as a ``TensorRef``: storage,
the storage's write count at that moment (its *version*: a later write does not change what an earlier op read), and
the view geometry. Which arguments an op writes comes from its schema (``Tensor(a!)``), so no op list is needed to
record; replay calls the same aten overload on real tensors (``init_replay.py``).

Random numbers: on the meta device a random op draws nothing, but a normal build draws from the global generator
in program order. So each random op (aten tag ``nondeterministic_seeded``) is also run once on a scratch CPU tensor
of the same geometry, right after a snapshot of the generator state: the generator then advances exactly as in a
normal build (and stands where a normal build leaves it after the block), and replay restores the snapshot before
the op, so a unit replayed out of order draws the same numbers. Cost: the random fill a normal build does anyway
(so recording costs the time of a normal build's random initialization) and one host buffer of the largest
randomly initialized tensor, kept for the block (``ScratchPool``); ``torch.get_rng_state()`` is ~5 KB per random
op. The buffer is reused, not allocated per op: freeing a multi-MiB block per random op raises glibc's dynamic
mmap threshold and leaves later unit-sized buffers fragmenting the heap (measured on a 64-layer 1024-wide MLP under
NVMe offload: 128 MiB of resident heap after the build, 426 instead of 205 MiB peak in training).

What cannot be replayed is an error, never different weights: a meta tensor's value flowing into Python
(``.item()``, ``.tolist()``, numpy) raises at build time naming the module whose code did it; a value depending on
a meta tensor created outside the block raises at materialization naming the parameter or buffer. Values computed
outside torch (numpy, Python's ``random``) reach the model as CPU tensors or Python scalars: they are recorded as
constants, so they replay exactly. Writes on the meta model *after* the block are not recorded: one through the
tensor itself is detected at materialization (its version counter moved) and raises; one through ``.data`` (a
fresh version counter) cannot be seen — initialize inside the block. ``torch.tensor(data)`` builds its meta
result without any aten op visible to the dispatch mode, so a ``TorchFunctionMode`` records its data as a constant
(GPT-2's ``masked_bias``).

[Note: meta shortcuts] Four ``torch.nn.init`` functions return at once on a meta tensor, in Python, before any op
(``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_`` in torch 2.13: data-dependent loops or decompositions),
and they do not go through ``__torch_function__``. Unseen, the tensor would keep its earlier value (or none) and the
generator would lag behind a normal build for every later draw: silently different weights. Without patching them:
the ``is_meta`` property read *does* reach the function mode, so when it answers True to a caller whose code is one
of those functions (found by scanning ``torch.nn.init`` for code reading ``is_meta``), the call is recorded from
the caller's arguments as one write (the public function itself, replayed with the generator snapshot taken before
it: its rejection loop draws the same numbers again), and run once on a scratch CPU tensor to advance the
generator. (A torch without the shortcuts runs these functions' ops on the meta tensor: recorded as usual.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

aten = torch.ops.aten


class UnreplayableInitError(RuntimeError):
    """A value built under zero.Init depends on something materialization cannot recompute."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor argument as recorded: which storage, at which write count, seen through which view."""

    storage: int  # index into Recording.histories
    version: int  # number of the storage's writes that happened before this read
    offset: int  # storage offset, in elements of dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


@dataclass(frozen=True)
class Constant:
    """A non-meta tensor argument (computed on the CPU inside or before the block): its value, cloned."""

    value: torch.Tensor


@dataclass
class RecordedOp:
    func: Any  # torch._ops.OpOverload
    args: tuple[Any, ...]  # tensors replaced by TensorRef / Constant
    kwargs: dict[str, Any]
    rng_state: torch.Tensor | None = None  # default CPU generator state before the op (random ops)
    generator_state: torch.Tensor | None = None  # an explicit generator's state before the op


@dataclass
class Write:
    op: RecordedOp
    target: TensorRef  # the written view
    overwrites_all: bool  # writes every byte of the storage without reading it: earlier history is dead


@dataclass
class StorageHistory:
    nbytes: int
    keepalive: torch.Tensor  # a meta tensor on the storage: keeps its identity from being reused while recorded
    creation: tuple[RecordedOp, int] | None  # (op, flat output index); None: created outside the recording
    uninitialized: bool = False  # created by empty*/new_empty: no values until written
    writes: list[Write] = field(default_factory=list)


# ops whose result has no values (replayed as a NaN-filled allocation so unwritten floats are caught)
_EMPTY = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
# in-place ops that write every element of their target without reading it
_OVERWRITE = {
    aten.normal_,
    aten.uniform_,
    aten.fill_,
    aten.zero_,
    aten.copy_,
    aten.random_,
    aten.exponential_,
    aten.cauchy_,
    aten.log_normal_,
    aten.geometric_,
    aten.bernoulli_,
}


def is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class ScratchPool:
    """Host tensors for random ops run only to advance the generator ([Note: init recording]): carved from one
    grow-only byte buffer, reset per op, so the block allocates a few large buffers instead of one per op."""

    ALIGN = 64

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8, device="cpu")
        self._used = 0

    def reset(self, nbytes: int) -> None:
        """Start one op needing about ``nbytes`` in all (grows the buffer when short; contents are garbage)."""
        self._used = 0
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def take(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0) if all(shape) else 0
        nbytes = -(-extent * itemsize // self.ALIGN) * self.ALIGN
        if self._used + nbytes > self._buffer.numel():  # an op with more tensors than reset() was told of
            return torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
        flat = self._buffer[self._used : self._used + extent * itemsize].view(dtype)
        self._used += nbytes
        return flat.as_strided(shape, stride)

    def release(self) -> None:
        self._buffer, self._used = torch.empty(0, dtype=torch.uint8, device="cpu"), 0

    @staticmethod
    def nbytes_of(tensors: list[torch.Tensor]) -> int:
        return sum(ScratchPool.ALIGN + t.untyped_storage().nbytes() for t in tensors)


class Recording:
    """Every meta storage seen while one ``zero.Init`` block was active, with its creation and writes."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # storage key → index into histories
        self.histories: list[StorageHistory] = []
        self.scratch = ScratchPool()

    # --- references ----------------------------------------------------------------------------------------
    def storage_of(self, t: torch.Tensor) -> int:
        """The history index of a meta tensor's storage (an empty history, unknown creation, if unseen)."""
        key = _storage_key(t)
        found = self.index.get(key)
        if found is None:
            with _disable_current_modes():  # called from the function mode too: the alias is no op to record
                alias = t.detach()
            found = self.index[key] = len(self.histories)
            self.histories.append(StorageHistory(t.untyped_storage().nbytes(), alias, None))
        return found

    def known(self, t: torch.Tensor) -> bool:
        found = self.index.get(_storage_key(t))
        return found is not None and self.histories[found].creation is not None

    def ref(self, t: torch.Tensor) -> TensorRef:
        index = self.storage_of(t)
        return TensorRef(
            index, len(self.histories[index].writes), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype
        )

    def _arg(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_meta:
            return self.ref(value)
        return Constant(value.detach().clone())

    # --- recording -----------------------------------------------------------------------------------------
    def record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], spec: Any, run: Any
    ) -> Any:
        """Record one aten call whose inputs or outputs are meta tensors, then run it (``run``). ``flat, spec``:
        ``tree_flatten((args, kwargs))``, done once by the caller (flattening dominates the recording cost)."""
        recorded = [self._arg(a) for a in flat]
        op_args, op_kwargs = tree_unflatten(recorded, spec)
        op = RecordedOp(func, op_args, op_kwargs)
        if is_random(func):
            self._advance_generator_as_a_normal_build(op, func, args, kwargs)
        written = _written_tensors(func, args, kwargs)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        inputs = {id(t) for t in tensors}
        before = {_storage_key(t) for t in tensors}
        out = run()
        for t in written:
            if not t.is_meta:
                continue
            target = self.ref(t)
            history = self.histories[target.storage]
            reads_itself = any(
                isinstance(a, TensorRef) and a.storage == target.storage and a != target for a in recorded
            )
            whole = (
                target.offset == 0
                and target.numel * t.element_size() == history.nbytes
                and target.stride == _contiguous_strides(target.size)
            )
            overwrites = func.overloadpacket in _OVERWRITE and whole and not reads_itself
            history.writes.append(Write(op, target, overwrites))
        flat_out = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        for position, t in enumerate(flat_out):
            if not isinstance(t, torch.Tensor) or not t.is_meta or id(t) in inputs:
                continue
            key = _storage_key(t)
            if key in before:  # a view of an input: same storage, nothing new
                continue
            index = self.storage_of(t)
            history = self.histories[index]
            if history.creation is None and not history.writes:
                history.creation = (op, position)
                history.uninitialized = func.overloadpacket in _EMPTY
        return out

    def add_constant(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """A meta tensor whose value is known on the CPU (``torch.tensor(data)`` under the meta device)."""
        index = self.storage_of(t)
        history = self.histories[index]
        if history.creation is None and not history.writes:
            # replayed as a copy of the constant: aten._to_copy(Constant) — same path as torch.as_tensor(cpu)
            op = RecordedOp(aten._to_copy.default, (Constant(value.detach().clone()),), {"dtype": t.dtype})
            history.creation = (op, 0)

    def record_function(self, function: Callable[..., Any], arguments: dict[str, Any]) -> None:
        """A watched ``torch.nn.init`` function called on a meta tensor ([Note: meta shortcuts]): one write."""
        names = list(inspect.signature(function).parameters)
        tensor = arguments.get(names[0])
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return
        kwargs = {name: arguments[name] for name in names[1:] if name in arguments}
        generator = kwargs.get("generator")
        op = RecordedOp(function, (self.ref(tensor),), {k: v for k, v in kwargs.items() if k != "generator"})
        if isinstance(generator, torch.Generator):
            op.generator_state = generator.get_state()
        else:
            op.rng_state = torch.get_rng_state()
        with _disable_current_modes():
            self.scratch.reset(ScratchPool.nbytes_of([tensor]))
            scratch = self.scratch.take(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            function(scratch, **kwargs)  # draws what a normal build draws
        target = op.args[0]
        history = self.histories[target.storage]
        whole = (
            target.offset == 0
            and target.numel * tensor.element_size() == history.nbytes
            and target.stride == _contiguous_strides(target.size)
        )
        history.writes.append(Write(op, target, whole))

    def _advance_generator_as_a_normal_build(
        self, op: RecordedOp, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """See [Note: init recording]: snapshot the generator, then draw what a normal build would draw."""
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            op.generator_state = generator.get_state()
        else:
            op.rng_state = torch.get_rng_state()

        metas = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor) and v.is_meta]
        self.scratch.reset(ScratchPool.nbytes_of(metas))

        def scratch(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_meta:
                out = self.scratch.take(tuple(value.shape), tuple(value.stride()), value.dtype)
                # values do not change how many numbers a random op draws; keep them valid (probabilities, stds)
                return out.fill_(0.5 if out.is_floating_point() else 1)
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return value

        try:
            func(*tree_map(scratch, args), **tree_map(scratch, kwargs))
        except Exception as exc:
            raise UnreplayableInitError(
                f"zero.Init: random op {func} {_building_where()} could not be run on the CPU to advance the random "
                f"number generator as a normal build would ({exc})"
            ) from exc


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments the op's schema marks as written (``Tensor(a!)``), in- or out= variants alike."""
    out: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _building_where() -> str:
    """Which module's code is running (the innermost frame whose ``self`` is an nn.Module), for error messages."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            code = frame.f_code
            return f"in {type(owner).__name__}.{code.co_name} ({code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return "(outside any module's code)"
