"""One communicator per directed pipeline link: which links carry messages (pure), and their process groups.

[Note: pipeline links] Under NCCL every operation of a communicator runs in posting order on that communicator's
stream, and a send (beyond what NCCL buffers) completes only when its receive is posted. Over the default group
the messages of all of a rank's links share one stream, so a lone send still waiting for its receiver holds back
every later receive of that rank: a schedule that relies on a send completing on its own (interleaving does, at
p = 2 and 4) deadlocks. With one 2-rank group per *directed* link (stage a → stage b, per data and tensor index) a
group's stream carries only sends on one side and only receives on the other, in the schedule's FIFO order of that
link, so what one link waits for never holds back another: the schedule simulator's semantics (sends never block,
receives block until their message arrives, FIFO per directed link) hold as they do on gloo.

gloo needs none of it (a request there completes on its own), so the groups are created only for NCCL
(``build_links(per_direction=None)``); ``per_direction=True`` forces them (tests run them over gloo).
``new_group`` is collective over the whole world: every rank creates every link's groups, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from shardspeed.pipe.instructions import next_virtual
from shardspeed.topology import Topology, rank_of

__all__ = ["PipeLinks", "build_links", "directed_links"]


def directed_links(stages: int, chunks: int = 1) -> list[tuple[int, int]]:
    """The ``(sender, receiver)`` stage pairs that carry messages, sorted: activations from each virtual stage to
    the next (s → s+1; with ``chunks`` ≥ 2 also the wrap p−1 → 0), gradients back the other way. At two stages the
    wrap links are the plain ones; one stage has none."""
    links: set[tuple[int, int]] = set()
    for chunk in range(chunks):
        for stage in range(stages):
            nxt = next_virtual(stage, chunk, stages, chunks)
            if nxt is not None and nxt[0] != stage:
                links |= {(stage, nxt[0]), (nxt[0], stage)}
    return sorted(links)


class PipeLinks:
    """This rank's communicators: ``to(peer)`` carries its sends to ``peer``, ``from_(peer)`` its receives from
    ``peer`` (peers are global ranks)."""

    def __init__(self, me: int, groups: Mapping[tuple[int, int], Any]) -> None:
        self.me = me
        self._groups = dict(groups)  # (sender, receiver) global ranks → group

    def to(self, peer: int) -> Any:
        return self._group(self.me, peer)

    def from_(self, peer: int) -> Any:
        return self._group(peer, self.me)

    def _group(self, src: int, dst: int) -> Any:
        try:
            return self._groups[(src, dst)]
        except KeyError:
            known = ", ".join(f"{a}->{b}" for a, b in sorted(self._groups))
            raise ValueError(
                f"pipeline p2p: rank {src} -> rank {dst} is not a link of this pipeline (its links here: {known}); "
                "messages go only between neighbouring (virtual) stages of the same data and tensor index"
            ) from None

    def __len__(self) -> int:
        return len(self._groups)


def build_links(topology: Topology, chunks: int = 1, *, per_direction: bool | None = None) -> PipeLinks | None:
    """The per-direction groups of this rank's links, or None where the default group serves (gloo; one stage).
    ``per_direction`` None: only under NCCL. World-collective when it creates groups: every rank calls it."""
    if per_direction is None:
        per_direction = dist.get_backend() == "nccl"
    shape, layout = topology.shape, topology.layout
    links = directed_links(shape.pipe, chunks)
    if not per_direction or not links:
        return None
    me = topology.global_rank
    mine: dict[tuple[int, int], Any] = {}
    for a, b in links:  # sorted: the same order on every rank
        for d in range(shape.data):
            for t in range(shape.tensor):
                src = layout[rank_of({"pipe": a, "data": d, "tensor": t}, shape)]
                dst = layout[rank_of({"pipe": b, "data": d, "tensor": t}, shape)]
                # Two groups over the same two ranks (a → b and b → a) are two communicators: two streams.
                group = dist.new_group(sorted((src, dst)))
                if me in (src, dst):
                    mine[(src, dst)] = group
    return PipeLinks(me, mine)
