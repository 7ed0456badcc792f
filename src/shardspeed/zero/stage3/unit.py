"""One ZeRO-3 unit: a set of parameters stored as this rank's 1/N shard and gathered whole on demand.

State machine (every transition asserts where it starts):

    SHARDED ──gather()──▶ GATHERING ──wait()──▶ UNSHARDED ──release()──▶ SHARDED

In SHARDED each parameter's ``.data`` is an empty placeholder (``numel() == 0``, as in DeepSpeed); the unit keeps
its flat shard. In UNSHARDED the parameters are views of one gathered flat buffer. The unit never writes
attributes onto its parameters; everything it knows lives here.

Every gather carries the unit-id check ([Note: unit-id check] in id_check.py): immediate on the CPU, read in
one batch at the step boundary on a device, so no gather waits on the host.

[Note: offloaded shard] With ``offload_param`` (param_offload.py) a unit has an ``offloader`` and its shard has
a sub-state orthogonal to the one above: *resident* (``shard`` holds the values; memory is the truth) or not
(``shard`` is an empty tensor; the store is the truth). ``fetch_shard`` makes it resident (reading the store
into a buffer from ``offloader.empty_shard``: a reusable pool buffer for shards read from NVMe),
``evict_shard`` writes it back if it was changed since it was read (``_shard_dirty``) and hands the buffer back
(``release_shard``), so nothing may keep a view of an evicted shard. ``gather`` fetches and ``wait`` evicts (the
all-gather has copied the shard by then), so between uses only the store holds it. Whoever writes the shard goes
through ``writable_shard``, which marks it dirty. Without an offloader (also a unit ``max_in_cpu`` keeps where
it is) the shard is always resident and these calls do nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.topology import AxisGroup
from shardspeed.zero.layout import padded_size
from shardspeed.zero.stage3.id_check import UnitIdCheck, UnitMismatchError

if TYPE_CHECKING:
    from shardspeed.zero.stage3.param_offload import ParamOffloader

__all__ = ["ParamUnit", "UnitMismatchError", "UnitState"]


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class ParamUnit:
    def __init__(
        self,
        index: int,
        name: str,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        axis: AxisGroup,
        collectives: Collectives,
        id_check: UnitIdCheck,
        *,
        device: torch.device | None = None,
        full: torch.Tensor | None = None,
    ) -> None:
        """``device``: where the shard lives (default: the parameters' device). ``full``: a padded flat buffer the
        parameters already are views of (zero.Init materialization), so sharding needs no second copy."""
        self.index, self.name = index, name
        self.params, self.names = list(params), list(names)
        self.axis, self.collectives = axis, collectives
        self.id_check = id_check  # shared by every unit and its gradients
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.padded_numel = padded_size(self.numel, axis.size)
        self.shard_numel = self.padded_numel // axis.size
        self.rank_start = axis.rank * self.shard_numel
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"ZeRO-3 unit '{name}' mixes parameter dtypes {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.device = device if device is not None else self.params[0].device
        self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        self.full: torch.Tensor | None = full
        self.state = UnitState.UNSHARDED  # parameters are whole until shard_from_params()
        self._work: Work | None = None
        self.persistent = False
        self.offloader: ParamOffloader | None = None  # set by Stage3States.offload_params
        self.shard_resident = True
        self._shard_dirty = False

    # --- construction --------------------------------------------------------------------------------------
    @torch.no_grad()
    def shard_from_params(self, broadcast_from_rank0: bool) -> None:
        """Take this rank's slice of the (whole) parameters and free the rest. Collective when broadcasting."""
        self._to(UnitState.SHARDED, UnitState.UNSHARDED)
        flat = (
            self.full if self.full is not None else torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        )
        self.pack_params_into(flat)
        flat[self.numel :].zero_()
        if broadcast_from_rank0:
            self.collectives.broadcast(flat, self.axis, 0, tag="init")
        self.shard.copy_(flat[self.rank_start : self.rank_start + self.shard_numel])
        self._point_params_at(None)
        self.full = None

    @torch.no_grad()
    def pack_params_into(self, flat: torch.Tensor) -> None:
        """Copy each parameter into its slot of ``flat`` unless it already is a view of that slot (its ``.data``
        may have been replaced, e.g. by ``p.data = new`` inside ``GatheredParameters``)."""
        for p, off, n in zip(self.params, self.offsets, self.numels):
            slot = flat[off : off + n]
            if n and p.data_ptr() != slot.data_ptr():
                slot.copy_(p.reshape(-1))

    # --- state machine -------------------------------------------------------------------------------------
    def _to(self, new: UnitState, expected: UnitState) -> None:
        assert self.state is expected, f"ZeRO-3 unit '{self.name}' is {self.state.value}, expected {expected.value}"
        self.state = new

    def gather(self) -> None:
        """Launch the all-gather of this unit (asynchronous); ``wait()`` makes the parameters whole."""
        self._to(UnitState.GATHERING, UnitState.SHARDED)
        self.fetch_shard()
        self.id_check.launch(self.index, "gather", self.device)
        self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        try:
            self._work = self.collectives.all_gather(self.full, self.shard, self.axis, async_op=True, tag="params")
        except BaseException:  # a refused launch (comm/order_check.py) leaves the unit sharded, so aborts can clean up
            self.state, self.full = UnitState.SHARDED, None
            raise

    def wait(self) -> None:
        self._to(UnitState.UNSHARDED, UnitState.GATHERING)
        assert self._work is not None
        self._work.wait()
        self._work = None
        self.id_check.after_wait()
        self.evict_shard()  # the gathered buffer holds a copy now
        self._point_params_at(self.full)

    def ensure_unsharded(self) -> None:
        if self.state is UnitState.SHARDED:
            self.gather()
        if self.state is UnitState.GATHERING:
            self.wait()

    def release(self) -> None:
        """Back to the shard only; the gathered buffer is freed (unless something else still references it)."""
        if self.state is UnitState.GATHERING:
            self.wait()
        self._to(UnitState.SHARDED, UnitState.UNSHARDED)
        self._point_params_at(None)
        self.full = None

    @torch.no_grad()
    def write_full(self, flat: torch.Tensor) -> None:
        """Replace this rank's shard from a whole (padded or unpadded) flat copy of the unit."""
        start = self.rank_start
        end = min(start + self.shard_numel, flat.numel())
        shard = self.writable_shard(keep_values=False)
        shard.zero_()
        if end > start:
            shard[: end - start].copy_(flat[start:end])

    # --- offloaded shard ([Note: offloaded shard]) -------------------------------------------------------------
    def fetch_shard(self) -> None:
        """Make the shard resident, reading it from the offload store if it is not."""
        if self.shard_resident:
            return
        assert self.offloader is not None
        shard = self.offloader.empty_shard(self)
        try:
            self.offloader.read(self, shard)
        except BaseException:
            self.offloader.release_shard(shard)  # a pool buffer must not leak with the failed read
            raise
        self.shard, self.shard_resident, self._shard_dirty = shard, True, False

    def writable_shard(self, keep_values: bool = True) -> torch.Tensor:
        """The resident shard, marked changed so ``evict_shard`` writes it back; ``keep_values=False`` skips
        reading it from the store when the caller overwrites all of it."""
        if not self.shard_resident:
            assert self.offloader is not None
            if keep_values:
                self.fetch_shard()
            else:
                self.shard, self.shard_resident = self.offloader.empty_shard(self), True
        self._shard_dirty = True
        return self.shard

    def evict_shard(self) -> None:
        """Write the shard to the offload store if it changed, then free it (no-op without an offloader)."""
        if self.offloader is None or not self.shard_resident:
            return
        if self._shard_dirty:
            self.offloader.write(self, self.shard)
        self.offloader.release_shard(self.shard)
        self.shard = torch.empty(0, dtype=self.dtype, device=self.device)
        self.shard_resident, self._shard_dirty = False, False

    def start_offload(self, offloader: ParamOffloader) -> None:
        """Hand the shard to ``offloader``: written to its store now, and resident only while used from now on
        (unless the offloader leaves it where it is: ``max_in_cpu`` on a shard already in host memory)."""
        if self.offloader is offloader or not offloader.moves(self):
            return  # already handed over (during construction: [Note: offload during construction])
        self.offloader = offloader
        self._shard_dirty = True
        if self.state is UnitState.SHARDED:
            self.evict_shard()

    def _point_params_at(self, flat: torch.Tensor | None) -> None:
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            if flat is None:
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            else:
                p.data = flat[off : off + n].view(shape)

    def nbytes(self) -> int:
        """Bytes of the shard in memory (0 while it is offloaded)."""
        return self.shard.numel() * self.shard.element_size()
