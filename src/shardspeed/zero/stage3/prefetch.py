"""What the ZeRO-3 runtime gathers next and what it evicts — the policy half of runtime.py, which keeps the hook
protocol (when a unit is acquired and when nothing needs it any more, see needs.py).

- Recorded order: the units each forward / backward pass acquired, in order (persistent units excluded; a unit
  counts once per backward). The next pass prefetches along the previous pass's order, but only while it has
  followed that order exactly, so every rank prefetches the same units in the same order (the all-gathers stay
  matched) and a pass that goes elsewhere just stops prefetching.
- Prefetch (``stage3_prefetch_bucket_size``): after acquiring a unit, gather the next units of the recorded order
  within ``prefetch_numel`` elements, so their all-gathers run while this one computes.
- Read-ahead (``offload_param``): start the local read of the shard of the unit after those (param_offload.py,
  [Note: read-ahead]); no collective, so no agreement needed. Reads nobody consumed are cancelled when a pass ends.
- Reuse (``stage3_max_reuse_distance``): in forward, a unit used again within that many gathered elements of the
  recorded order stays gathered after its call returns.
- Eviction (``stage3_max_live_parameters``): before a gather would pass the limit, gathered units nobody needs
  (prefetched, kept for reuse) are released, the longest-gathered first; what is needed (``must_stay``, decided by
  the runtime) stays, so the limit can still be passed by what one call needs at once.
- Peaks: the most gathered elements seen, overall and per phase (forward / backward, recomputation included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shardspeed.zero.stage3.unit import ParamUnit, UnitState


class GatherPolicy:
    def __init__(
        self, units: Sequence[ParamUnit], *, prefetch_numel: int, max_live_numel: int, max_reuse_distance: int
    ) -> None:
        self.units = list(units)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self._gathered_at = [0] * len(self.units)  # when this policy last gathered each unit (eviction order)
        self._clock = 0
        self._fwd_order: list[int] = []  # units in the order the previous forward acquired them
        self._fwd_now: list[int] = []
        self._bwd_order: list[int] = []
        self._bwd_now: list[int] = []
        self._bwd_seen: set[int] = set()
        self.peak_live_numel = 0
        self.peak_live_forward = 0  # gathered elements at most, while forward passes ran
        self.peak_live_backward = 0  # ... while backward ran (recomputation included)

    # --- passes ------------------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        self._fwd_now = []

    def end_forward(self) -> None:
        if self._fwd_now:
            self._fwd_order = self._fwd_now

    def start_backward(self) -> None:
        self._bwd_now, self._bwd_seen = [], set()

    def end_backward(self) -> None:
        if self._bwd_now:
            self._bwd_order = self._bwd_now

    # --- acquiring a unit --------------------------------------------------------------------------------------
    def acquire(self, u: int, backward: bool, must_stay: Callable[[int], bool]) -> None:
        """Gather unit u for use now (recording it in this pass's order, making room under the max-live limit
        first), then prefetch / read ahead along the previous pass's order."""
        unit = self.units[u]
        now, previous = (self._bwd_now, self._bwd_order) if backward else (self._fwd_now, self._fwd_order)
        if not unit.persistent:
            if not backward:
                now.append(u)
            elif u not in self._bwd_seen:
                self._bwd_seen.add(u)
                now.append(u)
        if unit.state is UnitState.SHARDED:
            self._make_room(unit.numel, keep=u, must_stay=must_stay)
            self._stamp(u)
        unit.ensure_unsharded()
        self._prefetch_after(now, previous)
        self._note_live(backward)

    def _stamp(self, u: int) -> None:
        self._clock += 1
        self._gathered_at[u] = self._clock

    def live(self) -> int:
        """Elements of all units gathered or being gathered."""
        return sum(x.numel for x in self.units if x.state is not UnitState.SHARDED)

    def _note_live(self, backward: bool) -> None:
        live = self.live()
        self.peak_live_numel = max(self.peak_live_numel, live)
        if backward:
            self.peak_live_backward = max(self.peak_live_backward, live)
        else:
            self.peak_live_forward = max(self.peak_live_forward, live)

    def reset_peaks(self) -> None:
        self.peak_live_numel = self.peak_live_forward = self.peak_live_backward = 0

    # --- eviction ----------------------------------------------------------------------------------------------
    def _make_room(self, numel: int, keep: int, must_stay: Callable[[int], bool]) -> None:
        """Before gathering ``numel`` more elements past ``stage3_max_live_parameters``: release gathered units
        nobody needs (kept for reuse, prefetched), the longest-gathered first. What is needed stays, so the limit
        can still be passed by what one call needs at once."""
        live = self.live()
        if live + numel <= self.max_live_numel:
            return
        idle = [
            v
            for v, unit in enumerate(self.units)
            if v != keep and not unit.persistent and unit.state is not UnitState.SHARDED and not must_stay(v)
        ]
        for v in sorted(idle, key=lambda v: self._gathered_at[v]):
            self.units[v].release()
            live -= self.units[v].numel
            if live + numel <= self.max_live_numel:
                return

    # --- prefetch and read-ahead -------------------------------------------------------------------------------
    def _prefetch_after(self, now: list[int], previous: list[int]) -> None:
        """Gather the next units of the previous pass's order while this one computes — only while this pass has
        followed that order exactly (so every rank prefetches the same units, in the same order). With offloaded
        parameters, start reading the shard of the unit after those too, so its read overlaps this compute."""
        if not now:
            return
        if previous[: len(now)] != now:  # units fetched ahead stay until used, evicted (max live) or the pass ends
            return
        budget = self.prefetch_numel
        live = self.live()
        position = len(now)
        for u in previous[len(now) :] if budget > 0 else ():
            unit = self.units[u]
            if unit.state is UnitState.SHARDED:
                if unit.numel > budget or live + unit.numel > self.max_live_numel:
                    break
                unit.gather()
                self._stamp(u)
                live += unit.numel
            budget -= unit.numel
            position += 1
            if budget <= 0:
                break
        self._read_ahead(previous[position:])

    def _read_ahead(self, upcoming: list[int]) -> None:
        """Start the offload read of the next unit still sharded in ``upcoming`` (param_offload.py): a local read,
        no collective, so it needs no agreement between ranks."""
        for u in upcoming:
            unit = self.units[u]
            if unit.state is UnitState.SHARDED:
                if unit.offloader is not None and not unit.shard_resident:
                    unit.offloader.read_ahead(unit)
                return

    def cancel_reads_ahead(self) -> None:
        seen: set[int] = set()
        for unit in self.units:
            if unit.offloader is not None and id(unit.offloader) not in seen:
                seen.add(id(unit.offloader))
                unit.offloader.cancel_reads_ahead()

    # --- reuse -------------------------------------------------------------------------------------------------
    def reused_soon(self, u: int) -> bool:
        """Whether unit u is used again later in this forward within max_reuse_distance gathered elements."""
        if self.max_reuse_distance <= 0:
            return False
        order, position = self._fwd_order, len(self._fwd_now)
        if order[:position] != self._fwd_now:  # off the recorded order: positions in it mean nothing
            return False
        distance = 0
        for later in order[position:]:
            if later == u:
                return True
            distance += self.units[later].numel
            if distance > self.max_reuse_distance:
                return False
        return False
