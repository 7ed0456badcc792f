"""Typed collectives over one mesh axis. Every call names its AxisGroup; a size-1 axis is a no-op.

This is the only module that calls torch.distributed collectives, so backend quirks live here:
- gloo has no PREMUL_SUM and no uneven all_gather: callers scale before/after and pad to equal shards.
- torch >= 2.13 prefers all_gather_single / reduce_scatter_single; older releases only have the *_tensor names.

With a failure board (``faults/board.py``) every wait is interruptible: synchronous calls are issued async and
waited through the board, so a peer's published failure (or death) raises here instead of hanging in gloo
([Note: failure propagation]). Without one (a world of one, ``propagate_failures: false``) calls are plain.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardspeed.comm import groups
from shardspeed.comm.algorithms import NATIVE, CollectiveChoice
from shardspeed.comm.arg_checks import check_all_to_all
from shardspeed.comm.blocked import BlockedTime, timed_wait
from shardspeed.comm.composite import (
    ALL_GATHER_SINGLE,
    REDUCE_SCATTER_SINGLE,
    Launched,
    all_gather_by_broadcast,
    all_gather_from_copy,
    in_slot,
    reduce_scatter_by_all_reduce,
    reduce_scatter_into_slot,
)
from shardspeed.comm.log import ALGORITHMIC_FACTOR, CommsLog
from shardspeed.comm.order_check import OrderChecker
from shardspeed.comm.simulated_link import Hold, SimulatedLink
from shardspeed.comm.work import CompositeWork, P2PWork, Work
from shardspeed.faults.board import FailureBoard
from shardspeed.topology import AxisGroup

_all_gather_single = ALL_GATHER_SINGLE
_reduce_scatter_single = REDUCE_SCATTER_SINGLE

__all__ = ["Collectives", "CompositeWork", "P2PWork", "Work"]  # the Works live in comm/work.py


class Collectives:
    """Collectives with an attached comms log. One per engine; passed down explicitly."""

    def __init__(
        self,
        log: CommsLog | None = None,
        board: FailureBoard | None = None,
        *,
        verify_order: bool = False,
        link: SimulatedLink | None = None,
    ) -> None:
        self.log = log or CommsLog(enabled=False)
        self.board = board
        self.link = link
        """A SIMULATED link every logged collective waits out ([Note: simulated link]); None: off (the default)."""
        self.blocked = BlockedTime()
        """Wall time this process's calls spent blocked waiting on communication ([Note: exposed communication])."""
        self.algorithms: CollectiveChoice = NATIVE
        """Which call carries each reduce-scatter / all-gather ([Note: collective algorithms]) over the axis named by
        its ``axis`` (others run native); every rank must hold the same choice (engine_setup.engine_collectives sets
        the one agreed over the world)."""
        self.algorithm_counts: dict[str, int] = defaultdict(int)
        """Calls per ``"<op>=<algorithm>"`` (``"reduce_scatter=all_reduce"``); the comms log keeps the logical op."""
        # [Note: collective-order verification] in comm/order_check.py: None (the default) costs one attribute
        # check per collective. Every rank must pass the same flag (engine_setup.engine_collectives agrees it).
        self.order: OrderChecker | None = (
            OrderChecker(self._exchange_digest, self._exchange_object) if verify_order else None
        )

    # --- the waiting path: everything below issues through here ---------------------------------------------------
    def _run(
        self,
        launch: object,
        axis: AxisGroup,
        op: str,
        tag: str,
        async_op: bool,
        timer: Callable[[], None] | None = None,
        hold: Hold | None = None,
    ) -> Work:
        """Issue ``launch(async_op)`` and return its Work, waited already unless ``async_op``: through the failure
        board when there is one (always issued async then), else as torch's own synchronous call. ``timer``: the
        comms log's latency callback, called when the call is seen complete ([Note: comms-log latency]);
        ``hold``: the simulated link's deadline ([Note: simulated link])."""

        doing, key = groups.describer(op, tag, axis), f"{op}:{tag}" if tag else op
        if self.board is None and not async_op:  # torch's own synchronous call: all of it is blocked time
            timed_wait(self.blocked, key, lambda: launch(False))  # type: ignore[operator]
            Work(None, blocked=self.blocked, key=key, on_complete=timer, hold=hold).wait()
            return Work(None)
        handle = launch(True)  # type: ignore[operator]
        work = Work(handle, self.board, doing, blocked=self.blocked, key=key, on_complete=timer, hold=hold)
        if not async_op:
            work.wait()
        return work

    def _run_composite(
        self,
        launch: Callable[[], Launched],
        axis: AxisGroup,
        op: str,
        tag: str,
        async_op: bool,
        timer: Callable[[], None] | None = None,
        hold: Hold | None = None,
    ) -> Work:
        """``_run`` for a logical op carried by several async calls: one ``CompositeWork``, waited already unless
        ``async_op``; blocked time recorded under the logical op's key."""

        key = f"{op}:{tag}" if tag else op
        doing = groups.describer(op, tag, axis)
        work = CompositeWork(launch(), self.board, doing, blocked=self.blocked, key=key, on_complete=timer, hold=hold)
        if not async_op:
            work.wait()
        return work

    def _algorithm(self, op: str, nbytes: int, axis: AxisGroup, unsharded: torch.Tensor) -> str:
        """Which call carries ``op``: the choice's, over the axis it was agreed for; native over any other axis
        (the choice is agreed world-wide but measured on the data axis: a tensor or pipe group of another size,
        e.g. tensor-parallel mappings, runs native) and for a non-contiguous ``unsharded``."""
        if not self.algorithms.applies_to(axis.name) or not unsharded.is_contiguous():
            return "native"
        return self.algorithms.algorithm(op, nbytes)

    def _record(
        self, op: str, tensor: torch.Tensor, axis: AxisGroup, tag: str
    ) -> tuple[Callable[[], None] | None, Hold | None]:
        """Log one call of ``op`` over ``axis`` moving ``tensor`` (the full, unsharded message): the comms log's
        completion timer, and the simulated link's deadline for its algorithmic bytes when a link is set."""
        numel, size = tensor.numel(), tensor.element_size()
        timer = self.log.record(op, numel, size, axis.size, tag, axis.name, axis.group)
        hold = None if self.link is None else self.link.hold(numel * size * ALGORITHMIC_FACTOR[op](axis.size))
        return timer, hold

    def all_reduce(self, tensor: torch.Tensor, axis: AxisGroup, *, async_op: bool = False, tag: str = "") -> Work:
        """Sum ``tensor`` in place over ``axis``."""
        if self.order is not None:
            self.order.check("all_reduce(sum)", axis, (tensor,), tag)
        if axis.size == 1:
            return Work(None)
        timer, hold = self._record("all_reduce", tensor, axis, tag)
        return self._run(
            lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=axis.group, async_op=a),
            axis,
            "all_reduce",
            tag,
            async_op,
            timer,
            hold,
        )

    def all_reduce_max(self, tensor: torch.Tensor, axis: AxisGroup, *, tag: str = "") -> None:
        if self.order is not None:
            self.order.check("all_reduce(max)", axis, (tensor,), tag)
        if axis.size == 1:
            return
        timer, hold = self._record("all_reduce", tensor, axis, tag)
        self._run(
            lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=axis.group, async_op=a),
            axis,
            "all_reduce(max)",
            tag,
            False,
            timer,
            hold,
        )

    def all_gather(
        self,
        unsharded: torch.Tensor,
        shard: torch.Tensor,
        axis: AxisGroup,
        *,
        async_op: bool = False,
        tag: str = "",
    ) -> Work:
        """Concatenate every rank's equal-sized ``shard`` into ``unsharded`` (size = shard × axis size). ``shard`` may
        be this rank's own slot of ``unsharded`` (in place: per-owner broadcasts and NCCL take it as is; gloo's native
        all-gather gets a copy, since its input aliasing its output is not documented to work)."""
        if self.order is not None:
            self.order.check("all_gather", axis, (shard, unsharded), tag)
        if unsharded.numel() != shard.numel() * axis.size:
            raise ValueError(f"all_gather: output {unsharded.numel()} != shard {shard.numel()} × {axis.size}")
        if axis.size == 1:
            if unsharded.data_ptr() != shard.data_ptr():
                unsharded.copy_(shard)
            return Work(None)
        timer, hold = self._record("all_gather", unsharded, axis, tag)
        nbytes = unsharded.numel() * unsharded.element_size()
        algorithm = self._algorithm("all_gather", nbytes, axis, unsharded)
        self.algorithm_counts[f"all_gather={algorithm}"] += 1
        if algorithm == "broadcast":
            return self._run_composite(
                lambda: all_gather_by_broadcast(unsharded, shard, axis), axis, "all_gather", tag, async_op, timer, hold
            )
        if in_slot(shard, unsharded, axis) and dist.get_backend(axis.group) != "nccl":
            # NCCL documents in-place all-gather; elsewhere the input gets its own memory, kept until the gather lands
            return self._run_composite(
                lambda: all_gather_from_copy(unsharded, shard, axis), axis, "all_gather", tag, async_op, timer, hold
            )
        return self._run(
            lambda a: _all_gather_single(unsharded, shard, group=axis.group, async_op=a),
            axis,
            "all_gather",
            tag,
            async_op,
            timer,
            hold,
        )

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        unsharded: torch.Tensor,
        axis: AxisGroup,
        *,
        async_op: bool = False,
        tag: str = "",
        clobber_input: bool = False,
    ) -> Work:
        """Sum ``unsharded`` over ``axis`` and keep this rank's equal slice in ``shard``. ``clobber_input``: the
        caller allows ``unsharded`` to be overwritten (an all-reduce-then-slice then runs in place, no scratch
        copy); without it the input is left as it was. With ``clobber_input``, ``shard`` may be this rank's own slot
        of ``unsharded`` (in place: the all-reduce leaves the result there, no copy)."""
        if self.order is not None:
            self.order.check("reduce_scatter(sum)", axis, (unsharded, shard), tag)
        if unsharded.numel() != shard.numel() * axis.size:
            raise ValueError(f"reduce_scatter: input {unsharded.numel()} != shard {shard.numel()} × {axis.size}")
        if axis.size == 1:
            if unsharded.data_ptr() != shard.data_ptr():
                shard.copy_(unsharded)
            return Work(None)
        timer, hold = self._record("reduce_scatter", unsharded, axis, tag)
        nbytes = unsharded.numel() * unsharded.element_size()
        algorithm = self._algorithm("reduce_scatter", nbytes, axis, unsharded)
        self.algorithm_counts[f"reduce_scatter={algorithm}"] += 1
        if algorithm == "all_reduce":
            return self._run_composite(
                lambda: reduce_scatter_by_all_reduce(shard, unsharded, axis, clobber_input),
                axis,
                "reduce_scatter",
                tag,
                async_op,
                timer,
                hold,
            )
        if in_slot(shard, unsharded, axis):
            if not clobber_input:
                raise ValueError("reduce_scatter: an in-place shard (its slot of the input) needs clobber_input=True")
            return self._run_composite(
                lambda: reduce_scatter_into_slot(shard, unsharded, axis),
                axis,
                "reduce_scatter",
                tag,
                async_op,
                timer,
                hold,
            )
        return self._run(
            lambda a: _reduce_scatter_single(shard, unsharded, op=dist.ReduceOp.SUM, group=axis.group, async_op=a),
            axis,
            "reduce_scatter",
            tag,
            async_op,
            timer,
            hold,
        )

    def broadcast(self, tensor: torch.Tensor, axis: AxisGroup, src_index: int = 0, *, tag: str = "") -> None:
        """Copy axis member ``src_index``'s tensor to every member (``src_index`` is an axis index, not global)."""
        if self.order is not None:
            self.order.check(f"broadcast(src={src_index})", axis, (tensor,), tag)
        if axis.size == 1:
            return
        timer, hold = self._record("broadcast", tensor, axis, tag)
        self._run(
            lambda a: dist.broadcast(tensor, src=axis.ranks[src_index], group=axis.group, async_op=a),
            axis,
            "broadcast",
            tag,
            False,
            timer,
            hold,
        )

    def all_to_all_single(
        self, output: torch.Tensor, tensor: torch.Tensor, axis: AxisGroup, *, async_op: bool = False, tag: str = ""
    ) -> Work:
        """Split ``tensor`` into ``axis.size`` equal blocks (along dim 0 when it divides evenly, else flat) and send
        block j to member j; ``output`` receives member i's block for this rank in block i. Equal splits only;
        ``output`` contiguous, not aliasing ``tensor`` (checked first: [Note: symmetric argument checks])."""
        check_all_to_all(output, tensor, axis)
        if self.order is not None:
            self.order.check("all_to_all", axis, (tensor, output), tag)
        if axis.size == 1:
            output.copy_(tensor.reshape(output.shape))
            return Work(None)
        timer, hold = self._record("all_to_all", tensor, axis, tag)
        out, src = output.view(axis.size, -1), tensor.reshape(axis.size, -1)  # dim 0 = destination member
        launch = lambda a: dist.all_to_all_single(out, src, group=axis.group, async_op=a)  # noqa: E731
        return self._run(launch, axis, "all_to_all", tag, async_op, timer, hold)

    def p2p(
        self,
        sends: Sequence[tuple[torch.Tensor, int] | tuple[torch.Tensor, int, str]],
        recvs: Sequence[tuple[torch.Tensor, int] | tuple[torch.Tensor, int, str]],
        *,
        tag: str = "",
        group: dist.ProcessGroup | None = None,
    ) -> P2PWork:
        """Post point-to-point sends and receives (peers are global ranks) as one ``batch_isend_irecv`` and return
        the pending Work: nothing is waited here. A third element in a pair overrides ``tag`` for that message in
        the comms log (the pipeline channel tells its meta headers from data so). ``group``: the communicator of
        every message of the batch (None: the default group); the pipeline's per-direction links (pipe/links.py).

        Sends and receives of one batch are posted together, so two ranks that exchange in the same call cannot
        deadlock under NCCL (a send waits on the device for its matching receive). A send's tensor must stay alive
        and unmodified until the Work completes (gloo reads it while sending): keep a reference until waited.
        Not a collective: collective-order verification does not apply (the pipeline's schedule, checked by its
        simulator, orders the messages on each link), and a rank that is neither sender nor receiver is not
        involved at all."""
        if not sends and not recvs:
            return P2PWork([], [], None, str)
        ops, is_send, timers = [], [], []
        for pairs, kind, op in ((sends, "send", dist.isend), (recvs, "recv", dist.irecv)):
            for tensor, peer, *override in pairs:
                message_tag = override[0] if override else tag
                timers.append(
                    self.log.record(kind, tensor.numel(), tensor.element_size(), 2, message_tag, "p2p", group)
                )
                ops.append(dist.P2POp(op, tensor, peer, group))
                is_send.append(kind == "send")

        def doing() -> str:
            to = sorted({op.peer for op, s in zip(ops, is_send, strict=True) if s})
            frm = sorted({op.peer for op, s in zip(ops, is_send, strict=True) if not s})
            return f"waiting in p2p{f' {tag!r}' if tag else ''} (sends to ranks {to}, receives from ranks {frm})"

        handles = dist.batch_isend_irecv(ops)
        keep = [op.tensor for op in ops]
        return P2PWork(handles, is_send, self.board, doing, keep=keep, blocked=self.blocked, tag=tag, timers=timers)

    def all_gather_object(self, obj: object, axis: AxisGroup) -> list[object]:
        """Small Python objects (validation fingerprints, RSS figures); not logged as traffic."""
        if self.order is not None:
            self.order.check("all_gather_object", axis)
        if axis.size == 1:
            return [obj]
        return self._gather_objects(obj, axis, axis.group)

    def _gather_objects(self, obj: object, axis: AxisGroup, group: dist.ProcessGroup | None) -> list[object]:
        """``all_gather_object`` over ``group`` (``axis`` names it in messages); not verified, not logged."""
        if self.board is None:
            out: list[object] = [None] * axis.size
            dist.all_gather_object(out, obj, group=group)
            return out
        # torch's all_gather_object has no async form: the same two steps (sizes, then padded bytes), each waited
        # through the board. NCCL moves device tensors only.
        device = groups.device_for(group)
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.zeros(axis.size, dtype=torch.int64, device=device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._run(
            lambda a: _all_gather_single(sizes, mine, group=group, async_op=a), axis, "all_gather_object", "", False
        )
        width = int(sizes.max())
        padded = torch.zeros(width, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        gathered = torch.empty(width * axis.size, dtype=torch.uint8, device=device)
        gather = lambda a: _all_gather_single(gathered, padded, group=group, async_op=a)  # noqa: E731
        self._run(gather, axis, "all_gather_object", "", False)
        host, counts = gathered.cpu(), sizes.tolist()
        return [pickle.loads(host[i * width : i * width + counts[i]].numpy().tobytes()) for i in range(axis.size)]

    # --- collective-order verification's own exchanges (raw: not verified, not logged) ------------------------------
    def _exchange_digest(self, digest: int, axis: AxisGroup) -> list[int]:
        """All-gather one int64 over ``axis`` (on ``WORLD`` when the axis spans it: see ``groups.check_group``); waited
        like every engine collective, so a failed peer interrupts the agreement too."""
        group = groups.check_group(axis)
        device = groups.device_for(group)
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        everyone = torch.empty(axis.size, dtype=torch.int64, device=device)
        self._run(lambda a: _all_gather_single(everyone, mine, group=group, async_op=a), axis, "order check", "", False)
        return everyone.tolist()

    def _exchange_object(self, obj: object, axis: AxisGroup) -> list[object]:
        return self._gather_objects(obj, axis, groups.check_group(axis))
