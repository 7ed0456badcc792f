"""The ZeRO-3 unit-id check, without a host sync per unit on a device.

[Note: unit-id check] gloo and NCCL match collectives by call order and size only. If two ranks gathered two
different same-sized units at the same point (different control flow), weights would silently swap. So every
unit gather and every unit gradient reduce-scatter is preceded by a tiny all-gather of the unit's index (N
integers, asynchronous, launched just before the data); the ids say, for each rank, which unit it reached.

Reading those ids is a host read. On a device that is a sync that stops the host from running ahead of the
device (prefetching, launching kernels), so one per unit would serialize the whole pass. Hence two modes:
- *immediate* (the ids live on the CPU: gloo on CPU tensors, where a read costs nothing): each check is read as
  soon as its unit's collective is waited for, and a mismatch raises at the very collective that diverged.
- *deferred* (a device): the ids stay on the device, queued; ``verify()`` reads the whole queue with one host
  read at a natural sync point (the optimizer step boundary, or every ``MAX_PENDING`` checks so an
  evaluation-only loop is checked too). A mismatch raises there, naming the first pair of units that differed.
  Until then a divergence of same-sized units computes on swapped weights (the step that follows raises);
  differently-sized collectives can hang NCCL before any check could run, as with any divergent collective.
The ids stay a separate collective: carrying them inside the gathered buffer would break the contiguity that
lets parameters be views of it (a rank's header would sit between its shard and the next rank's).

Mismatches are reported identically on every rank (every rank queued the same positions), as
``UnitMismatchError`` naming this rank's unit and the other rank's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.topology import AxisGroup

MAX_PENDING = 1024  # deferred checks queued before one is forced (a few KiB of device memory)


class UnitMismatchError(RuntimeError):
    """Ranks reached different ZeRO-3 units at the same collective (different control flow)."""


class UnitIdCheck:
    def __init__(self, axis: AxisGroup, collectives: Collectives, unit_names: Sequence[str], immediate: bool) -> None:
        self.axis, self.collectives = axis, collectives
        self.unit_names = list(unit_names)
        self.immediate = immediate
        self._pending: list[tuple[str, int, torch.Tensor, Work]] = []

    def launch(self, unit_index: int, what: str, device: torch.device) -> None:
        """All-gather ``unit_index`` over the axis (asynchronous); call before the unit's data collective."""
        if self.axis.size == 1:
            return
        ids = torch.empty(self.axis.size, dtype=torch.int64, device=device)
        mine = torch.full((1,), unit_index, dtype=torch.int64, device=device)
        work = self.collectives.all_gather(ids, mine, self.axis, async_op=True, tag="unit_ids")
        self._pending.append((what, unit_index, ids, work))

    def after_wait(self) -> None:
        """A unit's data collective was waited for: check now (immediate), or when the queue is full."""
        if self.immediate or len(self._pending) >= MAX_PENDING:
            self.verify()

    def verify(self) -> None:
        """Read every queued check (one host read) and raise on the first mismatch."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for _, _, _, work in pending:
            work.wait()
        rows = torch.stack([ids for _, _, ids, _ in pending]).tolist()  # the one host read
        for (what, index, _, _), others in zip(pending, rows):
            for rank_index, other in enumerate(others):
                if other != index:
                    raise self._mismatch(what, index, other, rank_index)

    def _mismatch(self, what: str, index: int, other: int, rank_index: int) -> UnitMismatchError:
        names = self.unit_names
        theirs = names[other] if 0 <= other < len(names) else f"#{other}"
        return UnitMismatchError(
            f"ZeRO-3 {what} order differs between ranks: this rank reached unit '{names[index]}' while "
            f"data-parallel rank {self.axis.ranks[rank_index]} reached unit '{theirs}'. All ranks must run "
            "the model's modules in the same order (data-dependent control flow must agree across ranks)."
        )
