"""``StreamedAdam``: Adam/AdamW whose states live outside the training device, stepped chunk by chunk on the CPU.

ZeRO offload (``zero_optimization.offload_optimizer``) wraps the torch Adam/AdamW the engine built over the
stage's stepped tensors. For every stepped tensor this rank owns, cut into ``sub_group_size`` chunks, the store
holds three tensors: the fp32 values, ``exp_avg`` and ``exp_avg_sq``. A step streams the chunks through
``stream_step`` (stream.py: overlap set by ``buffer_count`` and ``pipeline_read``/``pipeline_write``) and copies
each updated chunk back into the stepped tensor's values, so the ZeRO stage's own ``after_optimizer_step``
(all-gather) runs unchanged. ``ratio`` < 1 keeps the last chunks' state on the training device, stepped in place;
``fast_init`` skips writing the zero moments at start.

The stepped tensors' values are reached through a ``SteppedAccess`` (``open``/``close`` around every use). By
default a stepped tensor holds its values itself; ZeRO-3 fp32 with ``offload_param`` passes one whose stepped
tensors are stand-ins without storage and whose ``open`` reads the owning unit's shard from its store (``close``
writes it back), so the optimizer step keeps one unit's shard in memory at a time (param_offload.py).

[Note: masters in the store] Under bf16/fp16 the fp32 masters are the optimizer's "param" state, so keeping a
master shard in memory as well would hold 4Ψ/N bytes the offload is meant to free (device memory, with an
accelerator). The stage hands them over instead (``hand_masters_to_optimizer``): its stepped tensors become
stand-ins whose ``access`` reaches the *low-precision* parameters, and ``values_in_store`` tells this optimizer
that the store's values are the truth. Start-up seeds the store from the parameters (as a master is seeded);
each updated chunk is written into the parameters with a cast; checkpoints read and load the fp32 values through
``resident_pieces`` (one stepped tensor at a time); ``reseed`` follows a ``GatheredParameters`` edit.

Gradients: on an accelerator each bucket's final reduced gradient is copied to pinned host memory as the stage
reports it (``stage_grads``, host_grads.py), overlapping backward; later scaling (clipping, fp16 unscale) comes
through ``scale_grads`` and is applied as each host chunk is read. On the CPU the gradients are read in place.

Stores: a ``TensorSwapper`` (``device: "nvme"``: the states are in a swap file, host memory holds a few chunks)
or ``HostStore`` (``device: "cpu"`` with an accelerator: pinned host tensors; gradients are copied to the host
and updated values back). On a CPU-only machine ``device: "cpu"`` needs no wrapper at all: the states already
live in host memory.

The engine and the checkpoint code see a torch-optimizer look-alike: ``param_groups`` (the wrapped optimizer's
own group dicts, so LR schedulers keep working), ``step()`` and ``state`` (keyed by stepped tensor; reading it
swaps that tensor's state in, and ``after_checkpoint_load`` writes loaded state back to the store).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from shardspeed.checkpoint.pieces import Piece
from shardspeed.config.errors import ConfigError
from shardspeed.config.offload import OffloadOptimizerConfig

from .aio_config import AioSettings
from .chunks import Chunk, by_tensor, chunk_bounds, offloaded_mask, to_host
from .cpu_adam import cpu_adamw_step
from .grad_swap import GradSwap
from .host_grads import HostGradients
from .host_store import HostStore as HostStore  # re-exported: the parameter offloader imports it from here
from .host_store import StateStore as StateStore
from .step_outcome import run_agreed
from .stepped_access import ChunkWriter, DirectAccess, SteppedAccess
from .stream import (
    STREAM_STATES,
    StreamTimings,
    ZeroUntilWritten,
    init_stream_state,
    plan_pipeline,
    state_key,
    stream_step,
)
from .swapped_state import SwappedState
from .swapper import TensorSwapper


class StreamedAdam:
    """Adam/AdamW over chunks whose values and moments live in a ``StateStore`` (see the module docstring)."""

    FORCE_HOST_GRADS = False
    """Tests only: copy gradients to separate host buffers (``HostGradients``) even when they are on the CPU."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        store: StateStore,
        chunk_numel: int,
        access: SteppedAccess | None = None,
        offload: OffloadOptimizerConfig | None = None,
        values_in_store: bool = False,
        reopen: Callable[[], StateStore] | None = None,
        agree: Callable[[object], list[object]] | None = None,
        grad_window_bytes: int | None = None,
    ) -> None:
        """``access``: how to reach the stepped tensors' values (default: the tensors themselves). ``offload``:
        the ``offload_optimizer`` section (``buffer_count``, ``pipeline_read``/``pipeline_write``, ``fast_init``,
        ``ratio``); default: its defaults. ``values_in_store``: mixed precision whose fp32 masters this optimizer
        holds (see [Note: masters in the store]); ``access`` then reaches the low-precision copies. ``reopen``: a
        fresh, empty store sized for the groups' current tensors (``relayout``). ``agree``: the data-parallel
        all-gather every step's outcome goes through (NVMe: [Note: agreed offload step] in step_outcome.py).
        ``grad_window_bytes``: gradients live in the store too (``grad_swap``, grad_swap.py; the store must have
        been sized with ``bytes_needed(..., grads=True)``), with at most this many bytes of writes in flight."""
        check_streamable(inner)
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel = {chunk_numel}; valid: a positive number of elements")
        offload = offload if offload is not None else OffloadOptimizerConfig()
        self.pipeline = plan_pipeline(offload.buffer_count, offload.pipeline_read, offload.pipeline_write)
        self.optimizer_class_name = type(inner).__name__  # what checkpoints record ("Adam" / "AdamW")
        self.adam_w_mode = type(inner) is torch.optim.AdamW
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.values_in_store = values_in_store
        self.chunk_numel, self._offload = chunk_numel, offload
        self.reopen, self.agree = reopen, agree
        self.host_grads: HostGradients | None = None
        self.grad_window_bytes = grad_window_bytes
        self.grad_swap: GradSwap | None = None
        self.timings = StreamTimings()  # where the streamed steps' time went (the scale benchmark reports it)
        self.state = SwappedState(self)
        self._bind(store, access)

    def _bind(self, store: StateStore, access: SteppedAccess | None) -> None:
        """Cut the groups' current tensors into chunks and seed ``store`` with their values (zero moments)."""
        chunk_numel, offload, values_in_store = self.chunk_numel, self._offload, self.values_in_store
        self.access: SteppedAccess = access if access is not None else DirectAccess()
        self.steps = [0 for _ in self.param_groups]
        self.group_chunks: list[list[Chunk]] = []
        self.chunks_of: dict[int, list[Chunk]] = {}
        self._group_of: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            chunks = []
            for t, tensor in enumerate(group["params"]):
                # stand-ins reached through an access need not be contiguous: their values are elsewhere
                if tensor.dtype != torch.float32 or (access is None and not tensor.is_contiguous()):
                    raise ValueError(f"offloaded optimizer tensor {t} of group {g}: valid: contiguous fp32")
                mine = [
                    Chunk(f"g{g}t{t}c{start}", tensor, start, end)
                    for start, end in chunk_bounds(tensor.numel(), chunk_numel)
                ]
                chunks.extend(mine)
                self.chunks_of[id(tensor)] = mine
                self._group_of[id(tensor)] = g
            self.group_chunks.append(chunks)
        every = [chunk for chunks in self.group_chunks for chunk in chunks]
        for chunk, offloaded in zip(every, offloaded_mask([c.end - c.start for c in every], offload.ratio)):
            chunk.offloaded = offloaded
        # chunks ratio keeps on the device: their moments (and, with values_in_store, fp32 values) stay there
        self.resident: dict[str, list[torch.Tensor]] = {
            c.name: [torch.zeros(c.end - c.start, device=c.tensor.device) for _ in range(2 + values_in_store)]
            for c in every
            if not c.offloaded
        }
        offloaded_tensors = list({id(c.tensor): c.tensor for c in every if c.offloaded}.values())
        on_device = any(t.device.type != "cpu" for t in offloaded_tensors)
        # device gradients cross to the host per bucket as they become final (host_grads.py); CPU ones are read
        # where they are. A rebind keeps the object (the engine and the stage's final-gradient hook hold it).
        if self.host_grads is not None:
            self.host_grads.rebind(offloaded_tensors)
        elif (on_device or self.FORCE_HOST_GRADS) and self.grad_window_bytes is None:  # grad_swap: none to copy
            self.host_grads = HostGradients(offloaded_tensors, pin=on_device)
        fresh = {state_key(c.name, key) for c in every if c.offloaded for key in ("exp_avg", "exp_avg_sq")}
        self.store: StateStore = ZeroUntilWritten(store, fresh) if offload.fast_init else store  # type: ignore[assignment]
        if self.grad_window_bytes is not None:  # gradients in the store: a rebind keeps the object (the stage holds it)
            if self.grad_swap is None:
                self.grad_swap = GradSwap(self.store, self.chunks_of, self.grad_window_bytes)
            else:
                self.grad_swap.rebind(self.store, self.chunks_of)
        self.state.forget()
        self._write_values(first=True)

    def relayout(self, access: SteppedAccess | None) -> None:
        """The stage re-laid its buckets out before the first step ([Note: arrival-order layout] in
        zero/arrival_order.py) and put the new stepped tensors in ``param_groups``: drop the old store (an NVMe
        swap file frees its space first) and build chunks and a fresh store (``reopen``: collective for NVMe) for
        them, seeded with their values and zero moments. States to keep are written afterwards (``load_state``)."""
        if self.reopen is None:
            raise RuntimeError("this StreamedAdam was built without a way to reopen its store; it cannot re-lay out")
        self.store.close()
        self._bind(self.reopen(), access)

    @torch.no_grad()
    def load_state(self, tensor: torch.Tensor, entry: dict[str, Any], values: torch.Tensor | None = None) -> None:
        """Make ``entry`` (torch Adam's ``step``, ``exp_avg``, ``exp_avg_sq``) ``tensor``'s state and, when given,
        ``values`` (fp32) its values (with ``values_in_store`` those are the masters)."""
        if values is not None:
            self.write_values(tensor, values)
        self.state.loading[id(tensor)] = entry
        self._store_loaded(id(tensor))

    @staticmethod
    def bytes_needed(
        inner: torch.optim.Optimizer, chunk_numel: int, settings: AioSettings, ratio: float = 1.0, grads: bool = False
    ) -> int:
        """Swap-file size for ``inner``'s tensors cut into chunks: three fp32 states per offloaded chunk, four with
        ``grads`` (the chunk's gradient too: grad_swap.py)."""
        sizes = [
            end - start
            for group in inner.param_groups
            for tensor in group["params"]
            for start, end in chunk_bounds(tensor.numel(), chunk_numel)
        ]
        offloaded = [4 * size for size, keep in zip(sizes, offloaded_mask(sizes, ratio)) if keep]
        per_chunk = len(STREAM_STATES) + (1 if grads else 0)
        return max(TensorSwapper.bytes_needed([n for n in offloaded for _ in range(per_chunk)], settings), 1)

    @property
    def resident_state_bytes(self) -> int:
        """Bytes of the state ``ratio`` keeps on the training device (moments; with ``values_in_store`` also the
        fp32 values)."""
        return sum(t.numel() * t.element_size() for held in self.resident.values() for t in held)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("StreamedAdam.step does not take a closure (ZeRO offload steps reduced gradients)")
        if self.agree is None:
            self._step_groups()
            return
        run_agreed(self._step_groups, self.agree, f"offload_optimizer step {max(self.steps, default=0) + 1}")

    def _step_groups(self) -> None:
        self.state.forget()
        if self.grad_swap is not None:
            self.grad_swap.raise_failure()  # [Note: deferred gradient I/O failures]: inside the agreed outcome
        for g, (group, chunks) in enumerate(zip(self.param_groups, self.group_chunks)):
            if not chunks:
                continue
            self.steps[g] += 1
            beta1, beta2 = group["betas"]
            hyper = {
                "step": self.steps[g],
                "lr": float(group["lr"]),
                "betas": (float(beta1), float(beta2)),
                "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]),
                "adam_w_mode": self.adam_w_mode,
            }
            offloaded = [chunk for chunk in chunks if chunk.offloaded]
            writer = ChunkWriter(self.access, offloaded)
            try:
                # CPU tensors are used in place; device gradients are copied to the host first (cpu/nvme offload
                # with an accelerator), and updated values go back to the device tensor in the writer.
                names = [chunk.name for chunk in offloaded]
                swap = self.grad_swap
                if swap is None:
                    grads = [self._host_grad(chunk) for chunk in offloaded]
                    stream_step(
                        self.store,
                        names,
                        grads,
                        on_chunk_done=writer.write,
                        pipeline=self.pipeline,
                        timings=self.timings,
                        **hyper,
                    )  # type: ignore[arg-type]
                else:  # gradients read from the store with the states; ``grads`` only give the chunks' sizes
                    sizes = [chunk.of(chunk.tensor) for chunk in offloaded]
                    stream_step(
                        self.store,
                        names,
                        sizes,
                        on_chunk_done=writer.write,
                        pipeline=self.pipeline,
                        read_grad=lambda i, out, swap=swap, chunks=offloaded: swap.read(chunks[i], out),
                        grad_scale=swap.scale,
                        timings=self.timings,
                        **hyper,  # type: ignore[arg-type]
                    )
            finally:
                writer.finish()
            self._step_resident([chunk for chunk in chunks if not chunk.offloaded], hyper)

    def _host_grad(self, chunk: Chunk) -> torch.Tensor:
        """``chunk``'s gradient in host memory: its staged copy (scaled as the engine asked since), or in place."""
        if self.host_grads is None:
            return to_host(chunk.of(chunk.tensor.grad))
        grad = self.host_grads.take(chunk.tensor)[chunk.start : chunk.end]
        if self.host_grads.scale != 1.0:
            grad.mul_(self.host_grads.scale)  # each chunk is read once per step
        return grad

    # --- gradients staged to the host ([host_grads.py]); the engine wires these when host_grads is set --------
    @property
    def scales_grads(self) -> bool:
        """Whether this optimizer, not the stage, scales and forgets the gradients (host copies or the store)."""
        return self.host_grads is not None or self.grad_swap is not None

    def stage_grads(self, tensors: list[torch.Tensor]) -> None:
        """The stage's reduced gradients of ``tensors`` are final for this step: start their host copies."""
        assert self.host_grads is not None
        self.host_grads.stage(tensors)

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Scale this step's gradients: the host copies (or the store's) lazily, those ``ratio`` keeps on the device
        now."""
        if self.grad_swap is not None:
            self.grad_swap.scale *= factor
            return  # every chunk is offloaded (grad_swap needs ratio 1)
        assert self.host_grads is not None
        self.host_grads.scale_(factor)
        for chunks in self.group_chunks:
            for chunk in chunks:
                if not chunk.offloaded:
                    chunk.of(chunk.tensor.grad).mul_(factor)

    def forget_grads(self) -> None:
        """The step is over (taken or skipped): no host copy carries over to the next."""
        if self.host_grads is not None:
            self.host_grads.forget()
        if self.grad_swap is not None:
            self.grad_swap.reset_scale()  # the stored gradients themselves are the stage's to forget (zero_grads)

    def _step_resident(self, chunks: list[Chunk], hyper: dict[str, Any]) -> None:
        """Step the chunks ``ratio`` keeps on the device, in place, one stepped tensor open at a time."""
        for tensor, mine in by_tensor(chunks):
            values = self.access.open(tensor, writing=True)
            try:
                for chunk in mine:
                    exp_avg, exp_avg_sq, *master = self.resident[chunk.name]
                    grad = chunk.of(chunk.tensor.grad)
                    stepped = master[0] if master else chunk.of(values)
                    cpu_adamw_step(stepped, grad, exp_avg, exp_avg_sq, chunk_numel=max(grad.numel(), 1), **hyper)
                    if master:
                        chunk.of(values).copy_(master[0])  # the low-precision copy follows its fp32 master
            finally:
                self.access.close(tensor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the ZeRO stage's buffers, which the engine zeroes."""

    def read_state(self, tensor: torch.Tensor) -> dict[str, Any]:
        """``tensor``'s state in torch Adam's layout (``step``, ``exp_avg``, ``exp_avg_sq``), read from the store."""
        out: dict[str, Any] = {"step": torch.tensor(float(self.steps[self._group_of[id(tensor)]]))}
        for m, key in enumerate(("exp_avg", "exp_avg_sq")):
            full = torch.empty(tensor.numel(), dtype=torch.float32)
            for chunk in self.chunks_of[id(tensor)]:
                if chunk.offloaded:
                    self.store.swap_in(state_key(chunk.name, key), full[chunk.start : chunk.end]).wait()
                else:
                    full[chunk.start : chunk.end].copy_(self.resident[chunk.name][m])
            out[key] = full
        return out

    @torch.no_grad()
    def after_checkpoint_load(self) -> None:
        """Write what a checkpoint load put in memory back to the store: every tensor's (fp32) values, and the
        moments and step count of the entries the loader filled (those ``resident_pieces`` has not already
        written tensor by tensor)."""
        for tensor_id in list(self.state.loading):
            self._store_loaded(tensor_id)
        if not self.values_in_store:  # else the checkpoint pieces wrote them (resident_pieces)
            self._write_values(first=False)
        self.state.forget()

    def _store_loaded(self, tensor_id: int) -> None:
        """Move one tensor's loaded state (moments, step count) from memory to its homes."""
        entry = self.state.loading.pop(tensor_id, None)
        if entry is None:
            return
        self.steps[self._group_of[tensor_id]] = int(float(entry.get("step", 0)))
        for chunk in self.chunks_of[tensor_id]:
            for m, key in enumerate(("exp_avg", "exp_avg_sq")):
                if key not in entry:
                    continue
                part = entry[key].view(-1)[chunk.start : chunk.end]
                if chunk.offloaded:
                    self.store.swap_out(state_key(chunk.name, key), part.to("cpu", torch.float32).contiguous()).wait()
                else:
                    self.resident[chunk.name][m].copy_(part)

    def _write_values(self, first: bool, only: list[torch.Tensor] | None = None) -> None:
        """Every offloaded chunk's values (fp32) into the store, one stepped tensor open at a time (``only``:
        just these tensors); ``first``: also its zero moments, the state Adam starts from (unless ``fast_init``:
        then they read as zeros until the first step writes them). With ``values_in_store`` the kept chunks'
        masters are (re)set too. Each chunk is written before the next: host memory stays bounded by a chunk
        (plus what ``access.open`` brings in)."""
        wanted = None if only is None else {id(t) for t in only}
        for chunks in self.group_chunks:
            for tensor, mine in by_tensor(chunks):
                if wanted is not None and id(tensor) not in wanted:
                    continue
                values = self.access.open(tensor, writing=False)
                try:
                    for chunk in mine:
                        if not chunk.offloaded:
                            if self.values_in_store:
                                self.resident[chunk.name][2].copy_(chunk.of(values))
                            continue
                        part = to_host(values[chunk.start : chunk.end]).to(torch.float32)
                        if first and not isinstance(self.store, ZeroUntilWritten):
                            handles = init_stream_state(self.store, chunk.name, part)  # type: ignore[arg-type]
                        else:
                            handles = [self.store.swap_out(state_key(chunk.name, "param"), part)]
                        for handle in handles:
                            handle.wait()
                finally:
                    self.access.close(tensor)

    # --- [Note: masters in the store] ---------------------------------------------------------------------------
    def read_values(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s fp32 values as the optimizer holds them (a CPU copy), chunk by chunk from their homes. A
        stand-in the optimizer does not step (a trainable parameter left out of ``model_parameters``) was never
        changed, so its low-precision copy, upcast, is its value."""
        if id(tensor) not in self.chunks_of:
            values = self.access.open(tensor, writing=False)
            try:
                return values.to("cpu", torch.float32, copy=True)
            finally:
                self.access.close(tensor)
        full = torch.empty(tensor.numel(), dtype=torch.float32)
        for chunk in self.chunks_of[id(tensor)]:
            if chunk.offloaded:
                self.store.swap_in(state_key(chunk.name, "param"), full[chunk.start : chunk.end]).wait()
            elif self.values_in_store:
                full[chunk.start : chunk.end].copy_(self.resident[chunk.name][2])
            else:
                values = self.access.open(tensor, writing=False)
                try:
                    full[chunk.start : chunk.end].copy_(values[chunk.start : chunk.end])
                finally:
                    self.access.close(tensor)
        return full

    @torch.no_grad()
    def write_values(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Make ``values`` (fp32, ``tensor``'s size) the values of ``tensor``: in the store, in kept masters and
        in the copy reached through ``access``."""
        for chunk in self.chunks_of.get(id(tensor), []):
            part = values[chunk.start : chunk.end]
            if chunk.offloaded:
                self.store.swap_out(state_key(chunk.name, "param"), part.to("cpu").contiguous()).wait()
            elif self.values_in_store:
                self.resident[chunk.name][2].copy_(part)
        target = self.access.open(tensor, writing=True)
        try:
            target.copy_(values)
        finally:
            self.access.close(tensor)

    def reseed(self, tensors: list[torch.Tensor]) -> None:
        """The copies behind ``access`` were edited (``GatheredParameters``): make them the values again."""
        self._write_values(first=False, only=[t for t in tensors if id(t) in self.chunks_of])

    def resident_pieces(self, pieces: Iterable[Piece], writing: bool) -> Iterator[Piece]:
        """Checkpoint pieces, one stepped tensor at a time: with ``values_in_store`` their fp32 values are read in
        (and written back after the tensor's last piece when ``writing``); when ``writing`` (a load), each tensor's
        loaded moments also go to the store after its last piece, so a load holds one tensor's state, not all of
        it. Pieces come tensor by tensor (the stages' ``checkpoint_pieces`` order; a tensor met again is just
        read again); frozen ones pass through."""
        tensor: torch.Tensor | None = None
        values: torch.Tensor | None = None
        try:
            for piece in pieces:
                if piece.opt_tensor is None:  # frozen: the stage serves it
                    yield piece
                    continue
                if piece.opt_tensor is not tensor:
                    self._done_with(tensor, values, writing)
                    tensor = piece.opt_tensor
                    values = self.read_values(tensor) if self.values_in_store else None
                if values is None:
                    yield piece
                else:
                    yield dataclasses.replace(piece, value=values[piece.opt_offset : piece.opt_offset + piece.numel])
        finally:
            self._done_with(tensor, values, writing)

    def _done_with(self, tensor: torch.Tensor | None, values: torch.Tensor | None, writing: bool) -> None:
        if tensor is None or not writing:
            return
        if values is not None:
            self.write_values(tensor, values)
        if id(tensor) in self.chunks_of:
            self._store_loaded(id(tensor))

    def close(self) -> None:
        """Release the store (an NVMe swap file: its descriptor closes, which frees its disk space)."""
        # Every swap operation this optimizer starts is waited for by its caller (a step, a checkpoint load), which
        # raised its failure then, on every rank; the swap file keeps failed operations, and re-raising one here
        # would only repeat it at teardown (engine.destroy() after the reported fault). The file is released anyway.
        with contextlib.suppress(OSError):
            self.store.close()


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
