"""The pipeline's channel between stages: tuples of tensors sent and received over ``Collectives.p2p``.

[Note: pipeline channel] A message is a tuple of tensors on a named *stream* (the executor's ``"act"`` / ``"grad"``
and chunk) to or from one peer (a global rank). Its shapes and dtypes are negotiated once per ``(peer, stream)``: the
first message carries a meta header ahead of its data ([Note: pipeline message framing] in ``p2p_meta.py``), later
ones only data, each side allocating from the metas it recorded — so both sides must agree on the order of messages
on each link (the schedule guarantees it: instructions.py) and call ``reset_shapes()`` at the same point. With
``dynamic_shape`` every message carries its header. A sender whose tensors no longer match the negotiated metas
raises instead of letting the receiver read the bytes into the old shapes.

Deadlock freedom on gloo and NCCL alike: ``send`` only posts (its requests are kept, tensors included, until
``wait_sends()``); ``recv`` posts and waits; ``exchange`` posts every send and receive of a step in one batch (over
``links``: one per link, below), so two stages sending to each other never wait on each other's posting. A header must
be read before the data it describes can be received, so a negotiating call runs in *rounds*: per link, a round carries
data of known messages up to the next header and that header; its data follows in the next round, after the receiver has
read the header. Data never shares an NCCL batch with the header it depends on (one coalesced request: the receiver
could not finish reading the header before its whole batch, which would contain data the sender has not yet been able to
send, completes).
Once negotiated, a call is one round.

Under NCCL a rank's batches on one communicator run in posting order on one stream and a send (beyond what NCCL
buffers) completes only when its receive is posted, so over the default group a lone ``send`` holds back that rank's
later receives until the peer receives it — interleaved schedules, which rely on sends completing alone (the
simulator's model, and gloo's), deadlock. So under NCCL the channel gets ``links`` ([Note: pipeline links]:
``pipe/links.py``): one 2-rank group per directed link, sends to ``b`` on group (me → b), receives from ``b`` on group
(b → me), one batch per group (``batch_isend_irecv`` takes one group). Over links every send of a call is posted at
once (per link a batch ends with each header, so the receiver still reads a header before posting its data) and the
receives run in rounds per link: a send never waits on a receive, receives block only on their own link, and each
link is FIFO — the simulator's semantics. With gloo ``links`` is None: one batch per round over the default group, as
above. ``tests/unit/nccl_fabric.py`` models both on threads (``test_pipe_p2p_rounds.py``,
``test_pipe_p2p_links.py``: every schedule finishes over links; interleaving deadlocks without).

Partitioned messages (``partition``: the tensor axis; DeepSpeed's ``pipe_partitioned`` / ``grad_partitioned``): the
tensor ranks of a stage hold the same activation, so each sends only its 1/T slice of every float tensor to the same
tensor rank of the peer stage, and the receivers all-gather the slices over the tensor axis: p2p bytes drop to 1/T,
the tensor axis's (faster) links carry the rest. Integer/bool tensors and tensors of fewer than T elements go whole.

``stats``: ``wait_s`` is the time blocked waiting (the pipeline bubble's idle plus transfer time), ``post_s`` the
time spent posting, ``gather_s`` the partitioned all-gathers; ``messages`` / ``bytes`` what this rank sent and
received over p2p (headers included).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import Collectives, P2PWork
from shardspeed.pipe.links import PipeLinks
from shardspeed.pipe.p2p_meta import (
    HEADER_SLOTS,
    TensorMeta,
    decode_header,
    describe,
    encode_header,
    is_partitioned,
    partition_slice,
)
from shardspeed.topology import AxisGroup

__all__ = ["ChannelStats", "PipeChannel"]

Message = tuple[torch.Tensor, ...]


@dataclass
class ChannelStats:
    wait_s: float = 0.0  # blocked in receives and in wait_sends()
    post_s: float = 0.0  # posting requests (batch_isend_irecv)
    messages: int = 0  # tuples sent + received
    bytes: int = 0  # p2p bytes sent + received, headers included
    gather_s: float = 0.0  # partitioned messages' all-gathers over the tensor axis
    resets: int = 0  # reset_shapes() calls: shape renegotiations (curriculum length changes, eval batches)


@dataclass
class _Outgoing:
    peer: int
    stream: str
    header: torch.Tensor | None
    wire: list[torch.Tensor]


@dataclass
class _Incoming:
    peer: int
    stream: str
    index: int  # position in the caller's recvs
    metas: tuple[TensorMeta, ...] | None = None
    header: torch.Tensor | None = None  # posted, to be decoded after this round
    wire: list[torch.Tensor] = field(default_factory=list)


class PipeChannel:
    """Sends and receives tuples of tensors between pipeline stages ([Note: pipeline channel])."""

    def __init__(
        self,
        collectives: Collectives,
        device: torch.device,
        *,
        dynamic_shape: bool = False,
        partition: AxisGroup | None = None,
        links: PipeLinks | None = None,
    ) -> None:
        self.collectives = collectives
        self.links = links  # per-direction communicators (NCCL: pipe/links.py); None: the default group
        self.device = torch.device(device)
        self.dynamic_shape = dynamic_shape
        self.partition = partition if partition is not None and partition.size > 1 else None
        self._parts = self.partition.size if self.partition is not None else 1
        self._sent: dict[tuple[int, str], tuple[TensorMeta, ...]] = {}  # negotiated, per (peer, stream)
        self._received: dict[tuple[int, str], tuple[TensorMeta, ...]] = {}
        self._pending: list[P2PWork] = []  # posted sends, waited by wait_sends()
        self._stats = ChannelStats()
        self._rank = dist.get_rank()
        self._world = dist.get_world_size()

    # --- the API ----------------------------------------------------------------------------------------------------
    def send(self, tensors: Message, peer: int, stream: str) -> None:
        """Post ``tensors`` to ``peer``; never blocks (the send completes by ``wait_sends()``). The tensors are sent
        from their own storage where contiguous: do not modify them in place before ``wait_sends()``."""
        self._transfer(self._prepare([(tensors, peer, stream)], "send"), [])

    def recv(self, peer: int, stream: str) -> Message:
        """Receive the next message of ``stream`` from ``peer`` (blocks): fresh tensors with the sender's shapes and
        dtypes, ``requires_grad`` where the sender's float tensor required grad."""
        self._check_peer(peer, f"PipeChannel.recv from rank {peer} on stream {stream!r}", receiving=True)
        return self._transfer([], [_Incoming(peer, stream, 0)])[0]

    def exchange(self, sends: Sequence[tuple[Message, int, str]], recvs: Sequence[tuple[int, str]]) -> list[Message]:
        """Post every send and receive in one batch (rounds while negotiating); the received tuples in ``recvs``
        order. Sends complete by ``wait_sends()``."""
        outgoing = self._prepare(sends, "exchange")
        for peer, stream in recvs:
            self._check_peer(
                peer, f"PipeChannel.exchange receiving from rank {peer} on stream {stream!r}", receiving=True
            )
        return self._transfer(outgoing, [_Incoming(peer, stream, i) for i, (peer, stream) in enumerate(recvs)])

    def wait_sends(self) -> None:
        """Wait until every posted send has completed (its tensors may then be reused or freed)."""
        start = time.perf_counter()
        try:
            while self._pending:
                self._pending[0].sends.wait()
                self._pending.pop(0)
        finally:
            self._stats.wait_s += time.perf_counter() - start

    def reset_shapes(self) -> None:
        """Forget the negotiated metas: the next message of every stream carries a header again (every stage must
        reset at the same point: DeepSpeed's ``reset_activation_shape``)."""
        self._sent.clear()
        self._received.clear()
        self._stats.resets += 1

    @property
    def stats(self) -> ChannelStats:
        """A copy of the running totals."""
        return replace(self._stats)

    def reset_stats(self) -> None:
        self._stats = ChannelStats()

    # --- preparing messages -------------------------------------------------------------------------------------------
    def _check_peer(self, peer: int, where: str, *, receiving: bool = False) -> None:
        if not isinstance(peer, int) or peer == self._rank or not 0 <= peer < self._world:
            raise ValueError(f"{where}: peer {peer!r} is not another rank of this world of {self._world}")
        if self.links is not None:  # before anything is posted: a link the pipeline lacks is refused here
            if receiving:
                self.links.from_(peer)
            else:
                self.links.to(peer)

    def _prepare(self, sends: Sequence[tuple[Message, int, str]], call: str) -> list[_Outgoing]:
        """Check every message of a call, then record what it negotiates: a call refused for one message leaves
        the negotiated metas as they were (its peers never see any of it)."""
        negotiated: dict[tuple[int, str], tuple[TensorMeta, ...]] = {}
        outgoing = []
        for tensors, peer, stream in sends:
            where = f"PipeChannel.{call} to rank {peer} on stream {stream!r}"
            self._check_peer(peer, where)
            metas = describe(tensors, where)
            key = (peer, stream)
            known = negotiated.get(key, self._sent.get(key))
            header = None
            if self.dynamic_shape or known is None:
                header = torch.tensor(encode_header(metas, stream), dtype=torch.int64, device=self.device)
                negotiated[key] = metas
            elif known != metas:
                raise ValueError(_shape_change(where, known, metas))
            wire = [self._wire_out(t, meta) for t, meta in zip(tensors, metas, strict=True) if meta.numel > 0]
            outgoing.append(_Outgoing(peer, stream, header, wire))
        self._sent.update(negotiated)
        return outgoing

    def _wire_out(self, tensor: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        if not is_partitioned(meta, self._parts):
            return flat
        assert self.partition is not None
        start, length = partition_slice(meta.numel, self._parts, self.partition.rank)
        if start + length > meta.numel:  # the last slice reaches into the padding
            piece = torch.zeros(length, dtype=flat.dtype, device=flat.device)
            if start < meta.numel:
                piece[: meta.numel - start] = flat[start:]
            return piece
        return flat[start : start + length]

    def _wire_in(self, meta: TensorMeta) -> torch.Tensor | None:
        if meta.numel == 0:
            return None
        n = partition_slice(meta.numel, self._parts, 0)[1] if is_partitioned(meta, self._parts) else meta.numel
        return torch.empty(n, dtype=meta.dtype, device=self.device)

    def _assemble(self, message: _Incoming) -> Message:
        assert message.metas is not None
        wire = iter(message.wire)
        out = []
        for meta in message.metas:
            if meta.numel == 0:
                tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            elif is_partitioned(meta, self._parts):
                tensor = self._gather(next(wire), meta, message.stream)
            else:
                tensor = next(wire).view(meta.shape)
            out.append(tensor.requires_grad_(meta.requires_grad))
        return tuple(out)

    def _gather(self, piece: torch.Tensor, meta: TensorMeta, stream: str) -> torch.Tensor:
        assert self.partition is not None
        start = time.perf_counter()
        full = torch.empty(piece.numel() * self._parts, dtype=piece.dtype, device=self.device)
        self.collectives.all_gather(full, piece, self.partition, tag=f"pipe.{stream}.gather")
        self._stats.gather_s += time.perf_counter() - start
        return full[: meta.numel].view(meta.shape)

    # --- rounds -------------------------------------------------------------------------------------------------------
    def _transfer(self, outgoing: list[_Outgoing], incoming: list[_Incoming]) -> list[Message]:
        if self.links is not None:
            return self._transfer_linked(outgoing, incoming, self.links)
        out_links: dict[int, deque[_Outgoing]] = {}
        for message in outgoing:
            out_links.setdefault(message.peer, deque()).append(message)
        in_links: dict[int, deque[_Incoming]] = {}
        for message in incoming:
            in_links.setdefault(message.peer, deque()).append(message)
        while out_links or in_links:
            sends: list[tuple[torch.Tensor, int, str]] = []
            recvs: list[tuple[torch.Tensor, int, str]] = []
            headers: list[_Incoming] = []
            for peer, queue in list(out_links.items()):
                while queue:
                    message = queue[0]
                    if message.header is not None:  # the header now, its data next round
                        sends.append((message.header, peer, f"pipe.{message.stream}.meta"))
                        message.header = None
                        break
                    sends += [(w, peer, f"pipe.{message.stream}") for w in message.wire]
                    queue.popleft()
                if not queue:
                    del out_links[peer]
            for peer, queue in list(in_links.items()):
                self._next_recvs(peer, queue, recvs, headers)
                if not queue:
                    del in_links[peer]
            self._round(sends, recvs)
            self._decode(headers)
        self._stats.messages += len(outgoing) + len(incoming)
        return [self._assemble(message) for message in incoming]

    def _next_recvs(
        self,
        peer: int,
        queue: deque[_Incoming],
        recvs: list[tuple[torch.Tensor, int, str]],
        headers: list[_Incoming],
    ) -> None:
        """One round's receives from ``peer``: the data of messages whose metas are known, up to the next header."""
        while queue:
            message = queue[0]
            if message.metas is None:
                message.metas = None if self.dynamic_shape else self._received.get((peer, message.stream))
            if message.metas is None:
                message.header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
                recvs.append((message.header, peer, f"pipe.{message.stream}.meta"))
                headers.append(message)
                return
            message.wire = [w for w in map(self._wire_in, message.metas) if w is not None]
            recvs += [(w, peer, f"pipe.{message.stream}") for w in message.wire]
            queue.popleft()

    def _decode(self, headers: list[_Incoming]) -> None:
        for message in headers:
            assert message.header is not None
            message.metas = decode_header(message.header.tolist(), message.stream, message.peer)
            self._received[(message.peer, message.stream)] = message.metas
            message.header = None

    def _round(self, sends: list[tuple[torch.Tensor, int, str]], recvs: list[tuple[torch.Tensor, int, str]]) -> None:
        """Post one batch; wait its receives, keep its sends for ``wait_sends()``."""
        work = self._post(sends, recvs, None)
        if work is not None and recvs:
            self._wait_recvs([work])

    def _post(
        self, sends: list[tuple[torch.Tensor, int, str]], recvs: list[tuple[torch.Tensor, int, str]], group: Any
    ) -> P2PWork | None:
        """Post one batch on ``group`` (None: the default group); its sends are kept for ``wait_sends()``."""
        if not sends and not recvs:
            return None
        start = time.perf_counter()
        work = self.collectives.p2p(sends, recvs, tag="pipe", group=group)
        self._stats.post_s += time.perf_counter() - start
        self._stats.bytes += sum(t.numel() * t.element_size() for t, _, _ in (*sends, *recvs))
        if sends:
            # Completed sends are dropped as later ones are posted, so a caller that waits rarely holds only the
            # tensors still in flight.
            while self._pending and self._pending[0].sends.done():
                self._pending.pop(0)
            self._pending.append(work)
        return work

    def _wait_recvs(self, works: list[P2PWork]) -> None:
        start = time.perf_counter()
        try:
            for work in works:
                work.recvs.wait()
        finally:
            self._stats.wait_s += time.perf_counter() - start

    def _transfer_linked(self, outgoing: list[_Outgoing], incoming: list[_Incoming], links: PipeLinks) -> list[Message]:
        """``_transfer`` over per-direction communicators ([Note: pipeline links]). Every send is posted at once,
        on its link's group, whatever this call's receives will wait for: a send then never waits on a receive, as
        in the simulator. Per link a batch ends with each header (the receiver reads a header alone, then its data:
        the rounds below). Receives run in rounds as on the default group, one batch per incoming link."""
        batches: dict[int, list[tuple[torch.Tensor, int, str]]] = {}
        for message in outgoing:
            peer = message.peer
            batch = batches.setdefault(peer, [])
            if message.header is not None:
                batch.append((message.header, peer, f"pipe.{message.stream}.meta"))
                self._post(batch, [], links.to(peer))
                batches[peer] = batch = []
                message.header = None
            batch += [(w, peer, f"pipe.{message.stream}") for w in message.wire]
        for peer, batch in batches.items():
            self._post(batch, [], links.to(peer))
        in_links: dict[int, deque[_Incoming]] = {}
        for message in incoming:
            in_links.setdefault(message.peer, deque()).append(message)
        while in_links:
            works: list[P2PWork] = []
            headers: list[_Incoming] = []
            for peer, queue in list(in_links.items()):
                recvs: list[tuple[torch.Tensor, int, str]] = []
                self._next_recvs(peer, queue, recvs, headers)
                if not queue:
                    del in_links[peer]
                work = self._post([], recvs, links.from_(peer))
                if work is not None:
                    works.append(work)
            self._wait_recvs(works)
            self._decode(headers)
        self._stats.messages += len(outgoing) + len(incoming)
        return [self._assemble(message) for message in incoming]


def _shape_change(where: str, negotiated: tuple[TensorMeta, ...], now: tuple[TensorMeta, ...]) -> str:
    if len(negotiated) != len(now):
        change = f"the message now has {len(now)} tensors, the stream negotiated {len(negotiated)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(negotiated, now, strict=True)) if a != b)
        change = f"tensor {i} is now {now[i]}, the stream negotiated {negotiated[i]}"
    return (
        f"{where}: {change} on its first message. Shapes are negotiated once per stream; for inputs whose shapes "
        "vary pass dynamic_shape=True (PipelineModule(dynamic_shape=True)), or call "
        "engine.reset_activation_shape() on every stage before the batch whose shapes changed"
    )
