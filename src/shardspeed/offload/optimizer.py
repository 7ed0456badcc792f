"""``StreamedAdam``: Adam/AdamW whose states live outside the training device, stepped chunk by chunk on the CPU.

ZeRO offload (``zero_optimization.offload_optimizer``) wraps the torch Adam/AdamW the engine built over the
stage's stepped tensors (fp32 parameter-buffer slices, or fp32 master slices under mixed precision). For every
stepped tensor this rank owns, cut into ``sub_group_size`` chunks, the store holds three tensors: the fp32
values, ``exp_avg`` and ``exp_avg_sq``. A step streams the chunks through ``stream_step`` (read next ‖ step this
‖ write previous) and copies each updated chunk back into the stepped tensor, so the ZeRO stage's own
``after_optimizer_step`` (copy to low precision, all-gather) runs unchanged.

The stepped tensors' values are reached through a ``SteppedAccess`` (``open``/``close`` around every use). By
default a stepped tensor holds its values itself; ZeRO-3 fp32 with ``offload_param`` passes one whose stepped
tensors are stand-ins without storage and whose ``open`` reads the owning unit's shard from its store (``close``
writes it back), so the optimizer step keeps one unit's shard in memory at a time (param_offload.py).

Stores: a ``TensorSwapper`` (``device: "nvme"``: the states are in a swap file, host memory holds three chunks)
or ``HostStore`` (``device: "cpu"`` with an accelerator: pinned host tensors; gradients are copied to the host
and updated values back). On a CPU-only machine ``device: "cpu"`` needs no wrapper at all: the states already
live in host memory.

The engine and the checkpoint code see a torch-optimizer look-alike: ``param_groups`` (the wrapped optimizer's
own group dicts, so LR schedulers keep working), ``step()`` and ``state`` (keyed by stepped tensor; reading it
swaps that tensor's state in, and ``after_checkpoint_load`` writes loaded state back to the store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardspeed.config.errors import ConfigError

from .aio_config import AioSettings
from .cpu_adam import STREAM_STATES, init_stream_state, state_key, stream_step
from .setup import open_swapper_on_every_rank
from .stepped_access import ChunkWriter, DirectAccess, SteppedAccess
from .swapper import SwapHandle, TensorSwapper


class StateStore(Protocol):
    """What ``stream_step`` needs of a store: named 1-D tensors written and read asynchronously."""

    def swap_out(self, name: str, tensor: torch.Tensor) -> SwapHandle: ...

    def swap_in(self, name: str, out: torch.Tensor) -> SwapHandle: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _DoneHandle:
    """A finished operation (host copies are synchronous); ``wait`` returns the tensor like ``SwapHandle``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor

    def done(self) -> bool:
        return True


class HostStore:
    """States in (pinned, when an accelerator is present) host memory, with the swapper's interface."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()  # pinning needs an accelerator runtime
        self._tensors: dict[str, torch.Tensor] = {}

    def swap_out(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        held = self._tensors.get(name)
        if held is None or held.numel() != tensor.numel():
            held = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=self.pin_memory)
            self._tensors[name] = held
        held.copy_(tensor.view(-1))
        return _DoneHandle(tensor)  # type: ignore[return-value]

    def swap_in(self, name: str, out: torch.Tensor) -> SwapHandle:
        if name not in self._tensors:
            raise KeyError(f"swap_in({name!r}): nothing stored under that name")
        out.view(-1).copy_(self._tensors[name])
        return _DoneHandle(out)  # type: ignore[return-value]

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self._tensors.clear()


@dataclass
class _Chunk:
    name: str  # store prefix of its three states
    tensor: torch.Tensor  # the stepped tensor it is a piece of
    start: int
    end: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1)[self.start : self.end]


class _SwappedState:
    """``optimizer.state`` for the checkpoint code: reading a tensor's entry swaps its moments in.

    ``get`` (saving) keeps one tensor's state in memory at a time; ``[tensor]`` (loading) keeps every entry it
    hands out until ``StreamedAdam.after_checkpoint_load`` writes them back to the store.
    """

    def __init__(self, owner: StreamedAdam) -> None:
        self._owner = owner
        self._last: tuple[int, dict[str, Any]] | None = None
        self.loading: dict[int, dict[str, Any]] = {}

    def get(self, tensor: torch.Tensor, default: Any = None) -> Any:
        key = id(tensor)
        if key in self.loading:
            return self.loading[key]
        if key not in self._owner.chunks_of:
            return default
        if self._last is None or self._last[0] != key:
            self._last = (key, self._owner.read_state(tensor))
        return self._last[1]

    def __getitem__(self, tensor: torch.Tensor) -> dict[str, Any]:
        key = id(tensor)
        if key not in self._owner.chunks_of:
            raise KeyError("not a tensor this optimizer steps")
        if key not in self.loading:
            self.loading[key] = self._owner.read_state(tensor)
        return self.loading[key]

    def __contains__(self, tensor: object) -> bool:
        return id(tensor) in self._owner.chunks_of

    def __len__(self) -> int:
        return len(self._owner.chunks_of)

    def values(self) -> list[dict[str, Any]]:
        """Only the entries currently in memory (the rest are in the store, not host memory)."""
        return list(self.loading.values())

    def __iter__(self) -> Iterator[int]:
        return iter(self.loading)

    def forget(self) -> None:
        self._last = None
        self.loading.clear()


class StreamedAdam:
    """Adam/AdamW over chunks whose values and moments live in a ``StateStore`` (see the module docstring)."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        store: StateStore,
        chunk_numel: int,
        access: SteppedAccess | None = None,
    ) -> None:
        """``access``: how to reach the stepped tensors' values (default: the tensors themselves)."""
        check_streamable(inner)
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel = {chunk_numel}; valid: a positive number of elements")
        self.optimizer_class_name = type(inner).__name__  # what checkpoints record ("Adam" / "AdamW")
        self.adam_w_mode = type(inner) is torch.optim.AdamW
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.store = store
        self.access: SteppedAccess = access if access is not None else DirectAccess()
        self.steps = [0 for _ in self.param_groups]
        self.group_chunks: list[list[_Chunk]] = []
        self.chunks_of: dict[int, list[_Chunk]] = {}
        self._group_of: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            chunks = []
            for t, tensor in enumerate(group["params"]):
                # stand-ins reached through an access need not be contiguous: their values are elsewhere
                if tensor.dtype != torch.float32 or (access is None and not tensor.is_contiguous()):
                    raise ValueError(f"offloaded optimizer tensor {t} of group {g}: valid: contiguous fp32")
                mine = [
                    _Chunk(f"g{g}t{t}c{start}", tensor, start, min(start + chunk_numel, tensor.numel()))
                    for start in range(0, tensor.numel(), chunk_numel)
                ]
                chunks.extend(mine)
                self.chunks_of[id(tensor)] = mine
                self._group_of[id(tensor)] = g
            self.group_chunks.append(chunks)
        self.state = _SwappedState(self)
        self._write_values(first=True)

    @staticmethod
    def bytes_needed(inner: torch.optim.Optimizer, chunk_numel: int, settings: AioSettings) -> int:
        """Swap-file size for ``inner``'s tensors cut into chunks: three fp32 states per chunk."""
        sizes = []
        for group in inner.param_groups:
            for tensor in group["params"]:
                for start in range(0, tensor.numel(), chunk_numel):
                    sizes += [4 * (min(start + chunk_numel, tensor.numel()) - start)] * len(STREAM_STATES)
        return max(TensorSwapper.bytes_needed(sizes, settings), 1)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("StreamedAdam.step does not take a closure (ZeRO offload steps reduced gradients)")
        self.state.forget()
        for g, (group, chunks) in enumerate(zip(self.param_groups, self.group_chunks)):
            writer = ChunkWriter(self.access, chunks)
            if not chunks:
                continue
            self.steps[g] += 1
            # CPU tensors are used in place; device gradients are copied to the host first (cpu/nvme offload
            # with an accelerator), and updated values go back to the device tensor in on_chunk_done.
            grads = [_host(chunk.of(chunk.tensor.grad)) for chunk in chunks]
            beta1, beta2 = group["betas"]
            try:
                stream_step(
                    self.store,  # type: ignore[arg-type]
                    [chunk.name for chunk in chunks],
                    grads,
                    step=self.steps[g],
                    lr=float(group["lr"]),
                    betas=(float(beta1), float(beta2)),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adam_w_mode=self.adam_w_mode,
                    on_chunk_done=writer.write,
                )
            finally:
                writer.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the ZeRO stage's buffers, which the engine zeroes."""

    def read_state(self, tensor: torch.Tensor) -> dict[str, Any]:
        """``tensor``'s state in torch Adam's layout (``step``, ``exp_avg``, ``exp_avg_sq``), read from the store."""
        out: dict[str, Any] = {"step": torch.tensor(float(self.steps[self._group_of[id(tensor)]]))}
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.empty(tensor.numel(), dtype=torch.float32)
            for chunk in self.chunks_of[id(tensor)]:
                self.store.swap_in(state_key(chunk.name, key), full[chunk.start : chunk.end]).wait()
            out[key] = full
        return out

    @torch.no_grad()
    def after_checkpoint_load(self) -> None:
        """Write what a checkpoint load put in memory back to the store: every tensor's (fp32) values, and the
        moments and step count of the entries the loader filled."""
        for tensor_id, entry in self.state.loading.items():
            self.steps[self._group_of[tensor_id]] = int(float(entry.get("step", 0)))
            for chunk in self.chunks_of[tensor_id]:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in entry:
                        part = entry[key].view(-1)[chunk.start : chunk.end].to("cpu", torch.float32).contiguous()
                        self.store.swap_out(state_key(chunk.name, key), part).wait()
        self._write_values(first=False)
        self.state.forget()

    def _write_values(self, first: bool) -> None:
        """Every stepped tensor's values into the store, one tensor open at a time; ``first``: also its zero
        moments (the state Adam starts from). Each chunk is written before the next: host memory stays bounded
        by a chunk (plus what ``access.open`` brings in)."""
        for chunks in self.group_chunks:
            for tensor, mine in _by_tensor(chunks):
                values = self.access.open(tensor, writing=False)
                try:
                    for chunk in mine:
                        part = _host(values[chunk.start : chunk.end])
                        if first:
                            handles = init_stream_state(self.store, chunk.name, part)  # type: ignore[arg-type]
                        else:
                            handles = [self.store.swap_out(state_key(chunk.name, "param"), part)]
                        for handle in handles:
                            handle.wait()
                finally:
                    self.access.close(tensor)

    def close(self) -> None:
        """Release the store (deletes the swap directory)."""
        self.store.close()


def _by_tensor(chunks: list[_Chunk]) -> list[tuple[torch.Tensor, list[_Chunk]]]:
    """``chunks`` (tensor by tensor, in order) cut into runs of one stepped tensor each."""
    runs: list[tuple[torch.Tensor, list[_Chunk]]] = []
    for chunk in chunks:
        if runs and runs[-1][0] is chunk.tensor:
            runs[-1][1].append(chunk)
        else:
            runs.append((chunk.tensor, [chunk]))
    return runs


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of a device tensor; CPU tensors are returned as they are (no copy)."""
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


def check_streamable(optimizer: Any) -> None:
    """Only torch Adam/AdamW (no amsgrad, not maximizing) can be streamed: that is the update CPU Adam does."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            f"zero_optimization.offload_optimizer: offloading the optimizer needs Adam or AdamW, got "
            f"{type(optimizer).__name__}; use optimizer.type Adam/AdamW or set offload_optimizer.device to none"
        )
    for g, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise ConfigError(
                    f"optimizer.params.{key} = true (param group {g}) is not supported with offload_optimizer; "
                    "valid: false"
                )


def offload_optimizer(
    inner: torch.optim.Optimizer,
    device: str,
    *,
    nvme_path: str | None,
    pin_memory: bool,
    settings: AioSettings,
    chunk_numel: int,
    rank: int,
    agree: Callable[[object], list[object]],
    access: SteppedAccess | None = None,
) -> torch.optim.Optimizer | StreamedAdam:
    """Wrap ``inner`` for ``offload_optimizer.device``; collective over the data-parallel ranks (``agree`` is
    their all-gather of a small object), so a rank whose ``nvme_path`` is unusable fails every rank at once.

    "cpu" on a CPU-only machine returns ``inner`` itself: its states are already in host memory. ``access``:
    how the stepped tensors' values are reached (``StreamedAdam``), for a stage whose tensors are stand-ins.
    """
    if device == "none" or (device == "cpu" and not _has_accelerator(inner)):
        return inner
    check_streamable(inner)
    if device == "cpu":
        return StreamedAdam(inner, HostStore(pin_memory), chunk_numel, access)
    if device != "nvme":
        raise ValueError(f"offload_optimizer.device = {device!r}; valid: none, cpu, nvme")
    assert nvme_path is not None
    swapper = open_swapper_on_every_rank(
        nvme_path,
        lambda: StreamedAdam.bytes_needed(inner, chunk_numel, settings),
        settings,
        key="zero_optimization.offload_optimizer.nvme_path",
        job_prefix="shardspeed",
        rank=rank,
        agree=agree,
    )
    try:
        return StreamedAdam(inner, swapper, chunk_numel, access)
    except BaseException:
        swapper.abort()
        raise


def _has_accelerator(inner: torch.optim.Optimizer) -> bool:
    return any(t.device.type != "cpu" for group in inner.param_groups for t in group["params"])
